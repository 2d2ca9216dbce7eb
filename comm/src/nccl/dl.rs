//! The dynamic loader, by hand: opening a shared library by its path ([`SharedLib`]), looking
//! up its functions, and asking which file a loaded function lives in ([`file_of`]), the
//! question behind "which libcuda did cudarc open?".

use std::ffi::{c_void, CStr, CString};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// An opened shared library. It is never closed: the functions handed out stay valid for the
/// life of the process (as cudarc's own libraries do).
#[derive(Debug)]
pub struct SharedLib {
    handle: *mut c_void,
    path: PathBuf,
}

// SAFETY: a dlopen handle may be used from any thread; it is never closed.
unsafe impl Send for SharedLib {}
// SAFETY: as above (dlsym is thread-safe).
unsafe impl Sync for SharedLib {}

/// The loader's last error message.
fn dl_error() -> String {
    // SAFETY: dlerror returns a NUL-terminated string owned by the loader, or null.
    let message = unsafe { libc::dlerror() };
    if message.is_null() {
        "unknown error".into()
    } else {
        // SAFETY: non-null, NUL-terminated (above).
        unsafe { CStr::from_ptr(message) }
            .to_string_lossy()
            .into_owned()
    }
}

impl SharedLib {
    /// Opens the library at `path` (resolving its symbols now, so that a broken file fails
    /// here) with its symbols global, so that a later `dlopen` by its soname (cudarc's) finds
    /// this copy. The error is the loader's own message.
    pub fn open(path: &Path) -> Result<SharedLib, String> {
        let c_path = CString::new(path.as_os_str().as_encoded_bytes())
            .map_err(|_| format!("the path {} holds a NUL byte", path.display()))?;
        // SAFETY: a valid C string; the handle is kept for the life of the process.
        let handle = unsafe { libc::dlopen(c_path.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
        if handle.is_null() {
            return Err(dl_error());
        }
        Ok(SharedLib {
            handle,
            path: path.to_path_buf(),
        })
    }

    /// Opens a library by file name through the dynamic loader's own search
    /// (`LD_LIBRARY_PATH` as the process started, `/etc/ld.so.cache`, the default folders).
    pub fn open_by_name(name: &str) -> Result<SharedLib, String> {
        let c_name = CString::new(name).map_err(|_| format!("the name {name:?} holds a NUL"))?;
        // SAFETY: a valid C string; the handle is kept for the life of the process.
        let handle = unsafe { libc::dlopen(c_name.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
        if handle.is_null() {
            return Err(dl_error());
        }
        Ok(SharedLib {
            handle,
            path: PathBuf::from(name),
        })
    }

    /// The path it was opened from (or the name, for [`SharedLib::open_by_name`]).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The address of the function `name`, or an error naming it and the file.
    pub fn symbol(&self, name: &str) -> Result<*mut c_void, String> {
        let c_name = CString::new(name).map_err(|_| format!("the name {name:?} holds a NUL"))?;
        // SAFETY: a live handle and a valid C string.
        let address = unsafe { libc::dlsym(self.handle, c_name.as_ptr()) };
        if address.is_null() {
            Err(format!(
                "{} has no function {name} ({})",
                self.path.display(),
                dl_error()
            ))
        } else {
            Ok(address)
        }
    }

    /// The file the loader actually mapped for this library, found through one of its
    /// functions (`symbol`): for a library opened by name, where the loader found it.
    pub fn file(&self, symbol: &str) -> Option<PathBuf> {
        file_of(self.symbol(symbol).ok()?)
    }
}

/// The file of the loaded library that holds `address` (`dladdr`), if any.
pub fn file_of(address: *const c_void) -> Option<PathBuf> {
    let mut info = libc::Dl_info {
        dli_fname: std::ptr::null(),
        dli_fbase: std::ptr::null_mut(),
        dli_sname: std::ptr::null(),
        dli_saddr: std::ptr::null_mut(),
    };
    // SAFETY: dladdr only reads the loader's tables and fills `info`.
    let found = unsafe { libc::dladdr(address, &mut info) };
    if found == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: non-null, NUL-terminated, owned by the loader.
    let name = unsafe { CStr::from_ptr(info.dli_fname) };
    Some(PathBuf::from(std::ffi::OsStr::from_bytes(name.to_bytes())))
}

/// Whether two paths name the same file (after resolving links).
pub fn same_file(a: &Path, b: &Path) -> bool {
    match (std::fs::canonicalize(a), std::fs::canonicalize(b)) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_that_is_no_library_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("libnccl.so.2");
        std::fs::write(&path, b"not ELF").unwrap();
        let e = SharedLib::open(&path).unwrap_err();
        assert!(e.contains("libnccl.so.2"), "{e}");
    }

    #[test]
    fn the_c_library_is_found_and_located() {
        let libc = SharedLib::open_by_name("libc.so.6").unwrap();
        let file = libc.file("malloc").expect("dladdr finds malloc");
        assert!(
            file.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("libc"),
            "{file:?}"
        );
        let e = libc.symbol("no_such_function_here").unwrap_err();
        assert!(e.contains("no_such_function_here"), "{e}");
    }
}
