//! FNV-1a (64-bit): the workspace's one stable hash, the same on every platform and in every
//! release (not cryptographic). Job ids, replica checks, parameter-list comparison and
//! reproducibility digests all use it, so that two programs that hash the same bytes agree.

/// FNV-1a's 64-bit offset basis: the usual starting state of [`fnv1a_from`].
pub const FNV1A_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

/// FNV-1a's 64-bit prime.
const FNV1A_PRIME: u64 = 0x0000_0100_0000_01b3;

/// FNV-1a (64-bit) of `bytes`: a stable fingerprint, the same on every platform and in every
/// release (not cryptographic). Used for replica checks, parameter-list comparison, job ids and
/// reproducibility hashes.
pub fn fnv1a(bytes: &[u8]) -> u64 {
    fnv1a_from(FNV1A_OFFSET, bytes)
}

/// Continues FNV-1a from `state` over `bytes`: `fnv1a_from(fnv1a(a), b) == fnv1a(a ++ b)`, so
/// data can be hashed in pieces; a `state` other than [`FNV1A_OFFSET`] gives an independent
/// second hash of the same bytes.
pub fn fnv1a_from(state: u64, bytes: &[u8]) -> u64 {
    bytes
        .iter()
        .fold(state, |h, b| (h ^ u64::from(*b)).wrapping_mul(FNV1A_PRIME))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv1a_matches_the_published_test_vectors() {
        // From the FNV reference test suite (isthe.com/chongo/tech/comp/fnv).
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a(b"foobar"), 0x8594_4171_f739_67e8);
        assert_eq!(fnv1a_from(fnv1a(b"foo"), b"bar"), fnv1a(b"foobar"));
    }
}
