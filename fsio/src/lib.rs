//! ddp-fsio: [`atomic_write`], the one way ddp-rs writes a file that another process, or a later
//! run, reads (checkpoints, weight exports, data shards, downloads, flight records, error files).
//!
//! How, and why each step:
//!
//! 1. The bytes go to a fresh temporary file *in the target's folder* (`.<name>.<pid>.<n>.tmp`,
//!    created exclusively so that two writers never share one): a rename is atomic only within
//!    one file system, and the folder is the one place sure to be on the target's.
//! 2. The temporary file is synced (`fsync`): without it, a crash after the rename can leave the
//!    new name pointing at a file whose blocks never reached the disk (empty or torn), which is
//!    worse than the old file.
//! 3. It is renamed over the target: readers see the old file or the new one, never a mix.
//! 4. The folder is synced: the rename is a change of the folder, and only that sync makes it
//!    survive a crash (otherwise the old file may come back).
//!
//! If the caller's writer fails, or any step does, the temporary file is removed and the target
//! is untouched. A crash between the steps can leave a `.<name>.*.tmp` file, never a torn target.
#![warn(missing_docs)]

use std::fs::{File, OpenOptions};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Writes the file at `path` atomically and durably: `write` fills a temporary file in the same
/// folder, which is then synced, renamed over `path`, and the folder synced (see the crate
/// documentation for why each step). The file gets the permissions of any newly created file
/// (0666 less the umask on Unix).
///
/// An error of `write` is returned as it is; an error of the other steps names the path or the
/// folder and the step. Either way the temporary file is removed and `path` is left as it was
/// (except after a failure of the last step, the folder's sync: the new file is then in place,
/// but may not survive a crash).
pub fn atomic_write(
    path: impl AsRef<Path>,
    write: impl FnOnce(&mut File) -> io::Result<()>,
) -> io::Result<()> {
    let path = path.as_ref();
    let name = path.file_name().ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("cannot write {}: it names no file", path.display()),
        )
    })?;
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    let (tmp, mut file) = create_temporary(dir, &name.to_string_lossy())?;
    let written = write(&mut file).and_then(|()| {
        file.sync_all()
            .map_err(|e| context(e, format!("syncing {}", tmp.display())))
    });
    drop(file);
    let renamed = written.and_then(|()| {
        std::fs::rename(&tmp, path).map_err(|e| {
            context(
                e,
                format!("renaming {} to {}", tmp.display(), path.display()),
            )
        })
    });
    if let Err(e) = renamed {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    sync_folder(dir).map_err(|e| context(e, format!("syncing the folder {}", dir.display())))
}

/// A new, empty file `dir/.<name>.<pid>.<n>.tmp`, created exclusively (a name another writer
/// holds is skipped).
fn create_temporary(dir: &Path, name: &str) -> io::Result<(PathBuf, File)> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut options = OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o666);
    let pid = std::process::id();
    let mut last = None;
    for _ in 0..100 {
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let tmp = dir.join(format!(".{name}.{pid}.{n}.tmp"));
        match options.open(&tmp) {
            Ok(file) => return Ok((tmp, file)),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => last = Some(e),
            Err(e) => {
                return Err(context(
                    e,
                    format!("creating a temporary file in {}", dir.display()),
                ))
            }
        }
    }
    let e = last.unwrap_or_else(|| io::Error::from(io::ErrorKind::AlreadyExists));
    Err(context(
        e,
        format!(
            "creating a temporary file in {}: 100 names taken",
            dir.display()
        ),
    ))
}

/// Makes the folder's entries (a rename into it) durable.
#[cfg(unix)]
fn sync_folder(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Folders cannot be opened for syncing here; the rename is as durable as the platform makes it.
#[cfg(not(unix))]
fn sync_folder(_dir: &Path) -> io::Result<()> {
    Ok(())
}

/// `e` with `what` in front of its message, keeping its kind.
fn context(e: io::Error, what: String) -> io::Error {
    io::Error::new(e.kind(), format!("{what}: {e}"))
}

/// The README's code blocks, compiled (and run) as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// The names in `dir`, sorted.
    fn names(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn writes_a_new_file_and_replaces_an_old_one_leaving_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.json");
        atomic_write(&path, |f| f.write_all(b"one")).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"one");
        atomic_write(&path, |f| f.write_all(b"two, longer")).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"two, longer");
        assert_eq!(names(dir.path()), ["a.json"]);
    }

    #[cfg(unix)]
    #[test]
    fn the_file_gets_the_permissions_of_a_normally_created_one() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let normal = dir.path().join("normal");
        std::fs::write(&normal, b"x").unwrap();
        let atomic = dir.path().join("atomic");
        atomic_write(&atomic, |f| f.write_all(b"x")).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&atomic), mode(&normal));
    }

    #[test]
    fn a_failing_writer_leaves_the_old_file_and_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("b.bin");
        atomic_write(&path, |f| f.write_all(b"old")).unwrap();
        let err = atomic_write(&path, |f| {
            f.write_all(b"half of the new")?;
            Err(io::Error::other("checksum mismatch"))
        })
        .unwrap_err();
        assert_eq!(err.to_string(), "checksum mismatch", "returned as it is");
        assert_eq!(std::fs::read(&path).unwrap(), b"old");
        assert_eq!(names(dir.path()), ["b.bin"]);
    }

    #[test]
    fn a_missing_folder_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let folder = dir.path().join("no-such-folder");
        let err = atomic_write(folder.join("c"), |f| f.write_all(b"x")).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::NotFound);
        assert!(
            err.to_string().contains(&folder.display().to_string()),
            "{err}"
        );
        let err = atomic_write(dir.path().join(".."), |_| Ok(())).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput, "{err}");
    }

    /// Writers racing on one file while a reader reads it: the reader only ever sees whole
    /// versions, and every writer's temporary file is its own.
    #[test]
    fn concurrent_writers_never_show_a_reader_a_torn_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("shared.txt");
        let version = |w: usize, i: usize| format!("{w}:{i}:").repeat(2000);
        atomic_write(&path, |f| f.write_all(version(9, 0).as_bytes())).unwrap();
        std::thread::scope(|s| {
            for w in 0..3 {
                let path = &path;
                s.spawn(move || {
                    for i in 0..30 {
                        atomic_write(path, |f| f.write_all(version(w, i).as_bytes())).unwrap();
                    }
                });
            }
            for _ in 0..200 {
                let text = std::fs::read_to_string(&path).unwrap();
                let head: Vec<&str> = text.splitn(3, ':').collect();
                let (w, i) = (head[0].parse().unwrap(), head[1].parse().unwrap());
                assert!(text == version(w, i), "a torn file: {} bytes", text.len());
            }
        });
        assert_eq!(names(dir.path()), ["shared.txt"]);
    }
}
