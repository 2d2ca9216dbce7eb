//! What `--nproc-per-node auto`, `cpu` and `gpu` (and `PET_NPROC_PER_NODE`, as Kubeflow's
//! training operator sets it: `auto` by default) mean: torchrun's words, counted without CUDA
//! ([`nproc_per_node`]).
//!
//! torchrun counts with `torch.cuda.device_count()` and `os.cpu_count()`. ddprun links no CUDA
//! library, so it counts what the NVIDIA driver shows instead:
//!
//! - GPUs: the device nodes `/dev/nvidia<N>` (in a container, exactly the GPUs it was given;
//!   the NVIDIA container runtime creates only theirs), else, where no node exists yet (a host
//!   where no CUDA program has run since boot), the driver's list `/proc/driver/nvidia/gpus/*`
//!   (one directory per GPU). Then `CUDA_VISIBLE_DEVICES` as CUDA (and torch's own count
//!   without a CUDA context, `torch.cuda._parse_visible_devices`) reads it: a list of indices, or
//!   of `GPU-`/`MIG-` UUIDs, that ends at the first entry that is not one (an index that is
//!   negative or not below the GPUs found); empty means none, and a repeated entry means none.
//!   UUIDs are counted as given (no driver library to check them against), at most the GPUs
//!   found.
//! - CPUs: the CPUs this process may run on (`std::thread::available_parallelism`: its
//!   affinity and cgroup quota), where torchrun's `os.cpu_count()` counts the host's: in a pod
//!   limited to 4 of a host's 128 cores, `cpu` starts 4 ranks rather than 128.

use std::path::Path;

/// The number of ranks `value` asks for: a whole number of at least 1, or torchrun's `auto`
/// (the GPUs where the driver shows any, else the CPUs), `cpu` (the CPUs) or `gpu` (the GPUs;
/// an error without any). The error says what is wrong, for a message that names the flag or
/// variable.
pub fn nproc_per_node(value: &str) -> Result<usize, String> {
    nproc_with(value.trim(), gpu_count, cpu_count)
}

/// [`nproc_per_node`] with the counts given (the tests' seam).
fn nproc_with(
    value: &str,
    gpus: impl Fn() -> usize,
    cpus: impl Fn() -> usize,
) -> Result<usize, String> {
    match value {
        "cpu" => Ok(cpus()),
        "gpu" => match gpus() {
            0 => Err(format!(
                "`gpu` counts the GPUs, and none was found (no /dev/nvidia<N>, no \
                 /proc/driver/nvidia/gpus/*{}): give a number",
                visible_note()
            )),
            n => Ok(n),
        },
        "auto" => match gpus() {
            0 => Ok(cpus()),
            n => Ok(n),
        },
        _ => match value.parse::<usize>() {
            Ok(n) if n >= 1 => Ok(n),
            _ => Err(
                "not a whole number of at least 1, nor `auto`, `cpu` or `gpu` (torchrun's words)"
                    .into(),
            ),
        },
    }
}

/// `, CUDA_VISIBLE_DEVICES=...` when it is set, for the error without GPUs.
fn visible_note() -> String {
    ddp_comm::elastic::visible_devices()
        .map(|v| format!(", CUDA_VISIBLE_DEVICES={v:?}"))
        .unwrap_or_default()
}

/// The CPUs this process may run on.
pub(crate) fn cpu_count() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The GPUs this process may use (see the module documentation).
pub(crate) fn gpu_count() -> usize {
    count_gpus(
        Path::new("/dev"),
        Path::new("/proc/driver/nvidia/gpus"),
        ddp_comm::elastic::visible_devices().as_deref(),
    )
}

/// The GPUs under `dev` (`nvidia<N>` nodes), else under `proc_gpus` (one entry each), as
/// `visible` (`CUDA_VISIBLE_DEVICES`) lets a process see them.
fn count_gpus(dev: &Path, proc_gpus: &Path, visible: Option<&str>) -> usize {
    let entries = |dir: &Path| -> Vec<String> {
        std::fs::read_dir(dir)
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default()
    };
    let nodes = entries(dev)
        .iter()
        .filter(|name| {
            name.strip_prefix("nvidia")
                .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
        })
        .count();
    let installed = match nodes {
        0 => entries(proc_gpus).len(),
        n => n,
    };
    match visible {
        None => installed,
        Some(list) => visible_count(installed, list),
    }
}

/// How many of `installed` GPUs `CUDA_VISIBLE_DEVICES=list` leaves visible.
fn visible_count(installed: usize, list: &str) -> usize {
    let entries: Vec<&str> = list.split(',').map(str::trim).collect();
    if let Some(prefix) = ["GPU-", "MIG-"]
        .into_iter()
        .find(|p| list.trim().starts_with(p))
    {
        let mut seen: Vec<&str> = Vec::new();
        for e in entries {
            if seen.contains(&e) {
                return 0;
            }
            if !e.starts_with(prefix) {
                break;
            }
            seen.push(e);
        }
        return seen.len().min(installed);
    }
    let mut seen: Vec<u64> = Vec::new();
    for e in entries {
        // Like strtoul: the leading digits; an entry without any (or negative) ends the list.
        let digits: String = e.chars().take_while(char::is_ascii_digit).collect();
        let Ok(index) = digits.parse::<u64>() else {
            break;
        };
        if seen.contains(&index) {
            return 0;
        }
        if index >= installed as u64 {
            break;
        }
        seen.push(index);
    }
    seen.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn torchrun_s_words_count_gpus_then_cpus() {
        let (none, four) = (|| 0, || 4);
        let cpus = || 16;
        assert_eq!(nproc_with("auto", four, cpus), Ok(4));
        assert_eq!(nproc_with("auto", none, cpus), Ok(16));
        assert_eq!(nproc_with("cpu", four, cpus), Ok(16));
        assert_eq!(nproc_with("gpu", four, cpus), Ok(4));
        let e = nproc_with("gpu", none, cpus).unwrap_err();
        assert!(e.contains("none was found"), "{e}");
        assert_eq!(nproc_with("3", four, cpus), Ok(3));
        for bad in ["0", "-1", "two", "xpu", ""] {
            assert!(nproc_with(bad, four, cpus).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn gpus_are_the_driver_s_nodes_or_its_list_as_cuda_visible_devices_lets_them_be_seen() {
        let root = tempfile::tempdir().unwrap();
        let (dev, proc_gpus) = (root.path().join("dev"), root.path().join("gpus"));
        std::fs::create_dir_all(&dev).unwrap();
        std::fs::create_dir_all(&proc_gpus).unwrap();
        // No driver at all.
        assert_eq!(count_gpus(&dev, &proc_gpus, None), 0);
        assert_eq!(count_gpus(&root.path().join("none"), &proc_gpus, None), 0);
        // The driver's list only (no node created yet): two GPUs.
        for bus in ["0000:3b:00.0", "0000:af:00.0"] {
            std::fs::create_dir(proc_gpus.join(bus)).unwrap();
        }
        assert_eq!(count_gpus(&dev, &proc_gpus, None), 2);
        // Nodes: nvidia0..nvidia3 count, the control and UVM nodes do not; they win over the
        // list (a container given 4 of the host's GPUs, say).
        for name in [
            "nvidia0",
            "nvidia1",
            "nvidia2",
            "nvidia3",
            "nvidiactl",
            "nvidia-uvm",
        ] {
            std::fs::write(dev.join(name), "").unwrap();
        }
        std::fs::create_dir(dev.join("nvidia-caps")).unwrap();
        assert_eq!(count_gpus(&dev, &proc_gpus, None), 4);
        for (visible, want) in [
            ("", 0),
            ("0,1", 2),
            ("2", 1),
            ("1,3,0", 3),
            ("0,7,1", 1),
            ("0,-1,1", 1),
            ("0,x,1", 1),
            ("0,0", 0),
            ("GPU-aa,GPU-bb", 2),
            ("GPU-aa,1", 1),
            ("GPU-1,GPU-2,GPU-3,GPU-4,GPU-5", 4),
            ("MIG-x", 1),
            ("GPU-aa,GPU-aa", 0),
        ] {
            assert_eq!(
                count_gpus(&dev, &proc_gpus, Some(visible)),
                want,
                "CUDA_VISIBLE_DEVICES={visible:?}"
            );
        }
    }
}
