//! [`HostBuf`]: a flat `f32` buffer on the host that is either ours (`Vec<f32>`) or burn's own
//! memory (a tensor's bytes), so that a gradient or a parameter travels from burn to the
//! process group and back without a copy.
//!
//! burn's CPU backend allocates a tensor as bytes aligned to 16 (`Bytes`), which a `Vec<f32>`
//! cannot own (a `Vec` frees its memory with its element's alignment, 4): `TensorData::
//! try_into_vec::<f32>` copies every such tensor, at the moment the copy and the original are
//! both alive. A `HostBuf` keeps the bytes instead and lends them as `&mut [f32]`, which is
//! all the collectives need (`ProcessGroup::submit_*_in_place`), and gives them back to burn
//! as they came (`TensorData::from_bytes`, `Tensor::from_data`: no copy either).

use burn::tensor::{Bytes, DType, TensorData};

use crate::DdpError;

/// A flat `f32` buffer: ours, or burn's memory taken over (see the module documentation).
pub(crate) enum HostBuf {
    /// Allocated here.
    Vec(Vec<f32>),
    /// A burn tensor's bytes (`f32`, aligned for it).
    Bytes(Bytes),
}

impl HostBuf {
    /// `n` zeros of our own.
    pub fn zeros(n: usize) -> HostBuf {
        HostBuf::Vec(vec![0.0; n])
    }

    /// Takes over `data`'s memory when it holds `numel` `f32` values (no copy); other element
    /// types are converted (a copy, as they must be). A tensor of another size is an error
    /// naming `name` (`what`: "gradient", "values").
    pub fn from_data(
        data: TensorData,
        name: &str,
        what: &'static str,
        numel: usize,
    ) -> Result<HostBuf, DdpError> {
        if data.dtype() != DType::F32 {
            return to_f32(data, name, what, numel).map(HostBuf::Vec);
        }
        let bytes = data.into_bytes();
        match bytemuck::try_cast_slice::<u8, f32>(&bytes) {
            Ok(values) if values.len() == numel => Ok(HostBuf::Bytes(bytes)),
            Ok(values) => Err(DdpError::Conversion {
                name: name.to_string(),
                what,
                reason: format!("{} values, expected {numel}", values.len()),
            }),
            // Not aligned for f32 (never on burn's CPU backend): a copy.
            Err(_) => {
                let values: Vec<f32> = bytes
                    .chunks_exact(4)
                    .map(|b| f32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
                    .collect();
                if values.len() != numel {
                    return Err(DdpError::Conversion {
                        name: name.to_string(),
                        what,
                        reason: format!("{} values, expected {numel}", values.len()),
                    });
                }
                Ok(HostBuf::Vec(values))
            }
        }
    }

    /// The values as burn's tensor data of `shape` (no copy).
    pub fn into_data(self, shape: Vec<usize>) -> TensorData {
        match self {
            HostBuf::Vec(v) => TensorData::new(v, shape),
            HostBuf::Bytes(b) => TensorData::from_bytes(b, shape, DType::F32),
        }
    }

    /// Number of values.
    pub fn len(&self) -> usize {
        self.as_ref().len()
    }

    /// Where its values lie (to tell, in tests, that nothing was copied).
    #[cfg(test)]
    pub fn as_ptr(&self) -> *const f32 {
        self.as_ref().as_ptr()
    }
}

impl AsRef<[f32]> for HostBuf {
    fn as_ref(&self) -> &[f32] {
        match self {
            HostBuf::Vec(v) => v,
            HostBuf::Bytes(b) => bytemuck::cast_slice(b),
        }
    }
}

impl AsMut<[f32]> for HostBuf {
    fn as_mut(&mut self) -> &mut [f32] {
        match self {
            HostBuf::Vec(v) => v,
            HostBuf::Bytes(b) => bytemuck::cast_slice_mut(b),
        }
    }
}

impl From<Vec<f32>> for HostBuf {
    fn from(v: Vec<f32>) -> HostBuf {
        HostBuf::Vec(v)
    }
}

/// `data` as `numel` flat `f32` values, or an error naming `name`.
pub(crate) fn to_f32(
    data: TensorData,
    name: &str,
    what: &'static str,
    numel: usize,
) -> Result<Vec<f32>, DdpError> {
    let values = data
        .convert::<f32>()
        .try_into_vec::<f32>()
        .map_err(|e| DdpError::Conversion {
            name: name.to_string(),
            what,
            reason: format!("{e:?}"),
        })?;
    if values.len() != numel {
        return Err(DdpError::Conversion {
            name: name.to_string(),
            what,
            reason: format!("{} values, expected {numel}", values.len()),
        });
    }
    Ok(values)
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Device, Tensor};

    use super::*;

    /// A tensor of burn's CPU backend goes into a `HostBuf` and back without a copy: the
    /// values stay where burn put them.
    #[test]
    fn a_burn_tensor_travels_through_a_host_buffer_without_a_copy() {
        let device = Device::flex();
        let n = 1 << 16;
        let t = Tensor::<2>::ones([256, n / 256], &device).mul_scalar(3.0);
        let data = t.into_data();
        let at = data.as_bytes().as_ptr() as *const f32;
        let mut buf = HostBuf::from_data(data, "t", "values", n).unwrap();
        assert!(matches!(buf, HostBuf::Bytes(_)), "burn's bytes are kept");
        assert_eq!(buf.as_ptr(), at, "taken over, not copied");
        buf.as_mut()[5] = 7.0;
        let back = buf.into_data(vec![256, n / 256]);
        assert_eq!(back.as_bytes().as_ptr() as *const f32, at, "given back");
        let t = Tensor::<2>::from_data(back, &device);
        let values = t.into_data().try_to_vec::<f32>().unwrap();
        assert_eq!((values[4], values[5], values.len()), (3.0, 7.0, n));
        let e = HostBuf::from_data(TensorData::new(vec![1.0f32; 3], [3]), "w", "gradient", 4);
        assert!(e.is_err_and(|e| e.to_string().contains('w')));
    }
}
