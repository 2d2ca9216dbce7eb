//! Byte sizes as people write them (`4096`, `4K`, `16MiB`, `1G`: powers of 1024) and back, for
//! the launchers and benchmarks built on this crate; and the workspace's one FNV-1a hash.

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

/// Parses `4096`, `4K`, `4KiB`, `16M`, `1G` (powers of 1024) into bytes.
pub fn parse_size(text: &str) -> Result<usize, String> {
    let text = text.trim();
    let upper = text.to_ascii_uppercase();
    let digits = upper.trim_end_matches(|c: char| c.is_ascii_alphabetic());
    let shift = match &upper[digits.len()..] {
        "" | "B" => 0,
        "K" | "KB" | "KIB" => 10,
        "M" | "MB" | "MIB" => 20,
        "G" | "GB" | "GIB" => 30,
        unit => return Err(format!("unknown unit {unit:?} in size {text:?}")),
    };
    let number: usize = digits.parse().map_err(|_| format!("bad size {text:?}"))?;
    number
        .checked_mul(1 << shift)
        .ok_or_else(|| format!("size {text:?} too large"))
}

/// `4096` as `4 KiB`, `1048576` as `1 MiB`; other sizes in bytes.
pub fn human_size(bytes: usize) -> String {
    for (shift, unit) in [(30, "GiB"), (20, "MiB"), (10, "KiB")] {
        if bytes >= 1 << shift && bytes.is_multiple_of(1 << shift) {
            return format!("{} {unit}", bytes >> shift);
        }
    }
    format!("{bytes} B")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_round_trip() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("4K"), Ok(4096));
        assert_eq!(parse_size(" 16MiB "), Ok(16 << 20));
        assert_eq!(parse_size("1g"), Ok(1 << 30));
        assert!(parse_size("3X").unwrap_err().contains("unknown unit"));
        assert!(parse_size("K").is_err());
        assert!(parse_size("99999999999999999999G").is_err());
        assert_eq!(human_size(4096), "4 KiB");
        assert_eq!(human_size(256 << 20), "256 MiB");
        assert_eq!(human_size(1000), "1000 B");
    }

    #[test]
    fn fnv1a_matches_the_published_test_vectors() {
        // From the FNV reference test suite (isthe.com/chongo/tech/comp/fnv).
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a(b"foobar"), 0x8594_4171_f739_67e8);
        assert_eq!(fnv1a_from(fnv1a(b"foo"), b"bar"), fnv1a(b"foobar"));
    }
}
