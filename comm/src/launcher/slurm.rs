//! Slurm's compressed formats: node lists (`node[01-04,07]`) and task counts per node
//! (`2(x3),1`), read when the ranks run under `srun` (see `env.rs`).

/// Expands Slurm's compressed task counts: `2(x3),1` is `[2, 2, 2, 1]`.
pub(crate) fn parse_tasks_per_node(list: &str) -> Option<Vec<usize>> {
    let mut out = Vec::new();
    for item in list.trim().split(',') {
        let item = item.trim();
        if let Some((count, rest)) = item.split_once("(x") {
            let reps: usize = rest.strip_suffix(')')?.parse().ok()?;
            let count: usize = count.parse().ok()?;
            if reps > 100_000 {
                return None;
            }
            out.extend(std::iter::repeat_n(count, reps));
        } else {
            out.push(item.parse().ok()?);
        }
    }
    if out.is_empty() {
        None
    } else {
        Some(out)
    }
}

/// The first host of a Slurm node list: `node[01-04,07]` gives `node01`, `a,b` gives `a`,
/// `rack[1-2]-gpu[3,5]` gives `rack1-gpu3`, `host` gives `host`.
pub fn first_host(nodelist: &str) -> Option<String> {
    let list = nodelist.trim();
    // The first item at bracket depth 0.
    let mut depth = 0i32;
    let mut end = list.len();
    for (i, c) in list.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth -= 1,
            ',' if depth == 0 => {
                end = i;
                break;
            }
            _ => {}
        }
    }
    let item = &list[..end];
    // Replace every bracket group by the start of its first range.
    let mut host = String::new();
    let mut rest = item;
    while let Some(open) = rest.find('[') {
        host.push_str(&rest[..open]);
        let close = rest[open..].find(']')? + open;
        let inner = &rest[open + 1..close];
        let first = inner.split(',').next()?.split('-').next()?.trim();
        if first.is_empty() || !first.chars().all(|c| c.is_ascii_digit()) {
            return None;
        }
        host.push_str(first);
        rest = &rest[close + 1..];
    }
    if rest.contains(']') {
        return None;
    }
    host.push_str(rest);
    let host = host.trim().to_string();
    if host.is_empty() {
        None
    } else {
        Some(host)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slurm_node_lists() {
        assert_eq!(first_host("node[01-04,07]").as_deref(), Some("node01"));
        assert_eq!(first_host("node[07,01-04]").as_deref(), Some("node07"));
        assert_eq!(first_host("a,b").as_deref(), Some("a"));
        assert_eq!(first_host("host").as_deref(), Some("host"));
        assert_eq!(first_host(" host1 ").as_deref(), Some("host1"));
        assert_eq!(
            first_host("rack[1-2]-gpu[3,5],x").as_deref(),
            Some("rack1-gpu3")
        );
        assert_eq!(first_host("gpu[1-2],cpu[3-4]").as_deref(), Some("gpu1"));
        assert_eq!(first_host(""), None);
        assert_eq!(first_host("node[01-04"), None);
        assert_eq!(first_host("node[]"), None);
        assert_eq!(first_host("node]"), None);
    }

    #[test]
    fn slurm_tasks_per_node() {
        assert_eq!(parse_tasks_per_node("2(x3),1"), Some(vec![2, 2, 2, 1]));
        assert_eq!(parse_tasks_per_node("4"), Some(vec![4]));
        assert_eq!(parse_tasks_per_node("x"), None);
        assert_eq!(parse_tasks_per_node("2(x3"), None);
    }
}
