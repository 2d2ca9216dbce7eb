//! Byte sizes as people write them (`4096`, `4K`, `16MiB`, `1G`: powers of 1024) and back, for
//! the launchers, benchmarks and tools built on this crate (`--bytes 16M`, `4 KiB` in a table).

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
}
