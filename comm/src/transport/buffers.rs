//! Byte buffers for segments: [`PooledBuf`], 8-byte aligned so that it can be viewed as a slice
//! of any element type, and [`BufferPool`], which recycles them so that segments do not pay for
//! fresh (zeroed, page-faulting) memory every time. A link's reader takes its receive buffers
//! from the pool; a large buffer goes back to it when dropped (after a writer sent it, or after
//! the algorithm consumed it).

use std::sync::Arc;

use crossbeam_channel::{Receiver, Sender};

use crate::collectives::element::Element;

/// Buffers at least this many bytes long go back to their pool when dropped.
const POOL_MIN_BYTES: usize = 32 << 10;
/// Most buffers a pool keeps.
const POOL_CAPACITY: usize = 16;

/// Recycled buffer storage, so that segments do not pay for fresh (zeroed, page-faulting)
/// memory every time: a reader takes its receive buffer from here, and every large [`PooledBuf`]
/// returns here when dropped (after a writer sent it, or after the algorithm consumed it).
pub(crate) struct BufferPool {
    tx: Sender<Vec<u64>>,
    rx: Receiver<Vec<u64>>,
}

impl BufferPool {
    pub fn new() -> Arc<BufferPool> {
        let (tx, rx) = crossbeam_channel::bounded(POOL_CAPACITY);
        Arc::new(BufferPool { tx, rx })
    }

    /// A buffer of `len` bytes with unspecified contents (the caller overwrites all of them).
    pub fn buf(self: &Arc<Self>, len: usize) -> PooledBuf {
        let words = len.div_ceil(8);
        if len >= POOL_MIN_BYTES {
            if let Ok(mut v) = self.rx.try_recv() {
                if v.capacity() >= words {
                    v.resize(words, 0); // no work when the size repeats (the usual case)
                    return PooledBuf {
                        words: v,
                        len,
                        pool: Some(self.clone()),
                    };
                }
            }
        }
        PooledBuf {
            words: vec![0u64; words],
            len,
            pool: (len >= POOL_MIN_BYTES).then(|| self.clone()),
        }
    }

    /// A buffer holding a copy of `s`.
    pub fn copy_of<T: Element>(self: &Arc<Self>, s: &[T]) -> PooledBuf {
        let bytes: &[u8] = bytemuck::cast_slice(s);
        let mut b = self.buf(bytes.len());
        b.as_bytes_mut().copy_from_slice(bytes);
        b
    }
}

/// A byte buffer aligned to 8 bytes, so that it can be viewed as a slice of any [`Element`].
pub(crate) struct PooledBuf {
    words: Vec<u64>,
    len: usize,
    pool: Option<Arc<BufferPool>>,
}

impl Drop for PooledBuf {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.take() {
            let _ = pool.tx.try_send(std::mem::take(&mut self.words));
        }
    }
}

impl PooledBuf {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn as_bytes(&self) -> &[u8] {
        &bytemuck::cast_slice::<u64, u8>(&self.words)[..self.len]
    }

    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut::<u64, u8>(&mut self.words)[..self.len]
    }

    /// Views the bytes as elements; the length must be a multiple of the element size (the
    /// receiver checks every payload's length before this).
    pub fn as_slice<T: Element>(&self) -> &[T] {
        bytemuck::cast_slice(self.as_bytes())
    }
}
