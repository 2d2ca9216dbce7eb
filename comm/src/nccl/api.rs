//! NCCL's C functions, opened from the file that the search (`search.rs`) found
//! ([`NcclLibrary`]), rather than through cudarc: cudarc 0.19 opens NCCL only under the names
//! `libnccl.so`, `libnccl.so.12`, `.11`, `.10`, `.9` and `.1` (its `get_lib_name_candidates`),
//! never `libnccl.so.2`, the name NCCL's packages and pip wheels ship, and it takes no path. So
//! this file resolves the functions it needs from the library it opened itself, and what the
//! search found is what runs.
//!
//! The types are NCCL's C types as plain integers and pointers (a result code that a newer NCCL
//! invents must not be undefined behaviour in a Rust enum). NCCL 2.14 or newer is required:
//! communicators are created non-blocking (`ncclCommInitRankConfig` with `blocking = 0`), so
//! that their creation can be given a deadline (`init.rs`).

use std::ffi::{c_char, c_int, c_void, CStr};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use super::dl::SharedLib;
use super::search::{find_candidates, CudaLibrary, NotFound, SearchEnv};
use crate::collectives::element::{DType, ReduceOp};

/// A NCCL communicator (`ncclComm_t`).
pub(crate) type RawComm = *mut c_void;
/// A CUDA stream (`cudaStream_t`, the driver's `CUstream`).
pub(crate) type RawStream = *mut c_void;

/// NCCL's unique id (`ncclUniqueId`), passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct UniqueId {
    /// Opaque bytes.
    pub internal: [u8; 128],
}

/// A NCCL result code (`ncclResult_t`).
#[repr(transparent)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NcclResult(pub c_int);

impl NcclResult {
    /// `ncclSuccess`.
    pub const SUCCESS: NcclResult = NcclResult(0);
    /// `ncclUnhandledCudaError`: a CUDA call failed on this rank.
    pub const UNHANDLED_CUDA_ERROR: NcclResult = NcclResult(1);
    /// `ncclSystemError`: a system call failed (often a connection to a peer).
    pub const SYSTEM_ERROR: NcclResult = NcclResult(2);
    /// `ncclInternalError`.
    pub const INTERNAL_ERROR: NcclResult = NcclResult(3);
    /// `ncclInvalidArgument`.
    pub const INVALID_ARGUMENT: NcclResult = NcclResult(4);
    /// `ncclInvalidUsage`.
    pub const INVALID_USAGE: NcclResult = NcclResult(5);
    /// `ncclRemoteError`: a peer failed, or the network to it.
    pub const REMOTE_ERROR: NcclResult = NcclResult(6);
    /// `ncclInProgress`: a non-blocking call has not finished yet.
    pub const IN_PROGRESS: NcclResult = NcclResult(7);

    /// NCCL's name for the code.
    pub fn name(self) -> &'static str {
        match self.0 {
            0 => "ncclSuccess",
            1 => "ncclUnhandledCudaError",
            2 => "ncclSystemError",
            3 => "ncclInternalError",
            4 => "ncclInvalidArgument",
            5 => "ncclInvalidUsage",
            6 => "ncclRemoteError",
            7 => "ncclInProgress",
            _ => "an unknown NCCL result",
        }
    }

    /// Whether the code is an error (neither success nor in progress).
    pub fn is_error(self) -> bool {
        self != NcclResult::SUCCESS && self != NcclResult::IN_PROGRESS
    }

    /// Whether the error points at another rank or the network to it (a remote or system
    /// error) rather than at this rank (a CUDA error, an internal error, a misuse).
    pub fn points_elsewhere(self) -> bool {
        self == NcclResult::REMOTE_ERROR || self == NcclResult::SYSTEM_ERROR
    }
}

/// `ncclConfig_t` as NCCL 2.14 defined it (size, magic, version, blocking). NCCL copies the
/// `size` bytes given and takes the fields a later version added from its defaults, so this
/// prefix works with every NCCL from 2.14 on.
#[repr(C)]
struct Config {
    size: usize,
    magic: u32,
    version: u32,
    blocking: c_int,
    /// Padding to the struct's size; NCCL 2.17+ reads it as `cgaClusterSize` and then resets
    /// it (this config says version 2.14), so it holds NCCL's "undefined" value anyway.
    _undefined: c_int,
}

/// `NCCL_CONFIG_UNDEF_INT`.
const CONFIG_UNDEFINED: c_int = c_int::MIN;
/// `NCCL_VERSION(2, 14, 0)`: the oldest NCCL with non-blocking communicators.
const MIN_VERSION: c_int = 21400;

type Res = NcclResult;
type FnVersion = unsafe extern "C" fn(*mut c_int) -> Res;
type FnUniqueId = unsafe extern "C" fn(*mut UniqueId) -> Res;
type FnInitConfig = unsafe extern "C" fn(*mut RawComm, c_int, UniqueId, c_int, *mut Config) -> Res;
type FnAsyncError = unsafe extern "C" fn(RawComm, *mut Res) -> Res;
type FnComm = unsafe extern "C" fn(RawComm) -> Res;
type FnErrorString = unsafe extern "C" fn(Res) -> *const c_char;
type FnLastError = unsafe extern "C" fn(RawComm) -> *const c_char;
type FnReduceOp = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    RawComm,
    RawStream,
) -> Res;
type FnRooted = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    RawComm,
    RawStream,
) -> Res;
type FnGather =
    unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, RawComm, RawStream) -> Res;
type FnReduce = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    c_int,
    RawComm,
    RawStream,
) -> Res;
type FnGroup = unsafe extern "C" fn() -> Res;

/// A NCCL library opened from a file, with the functions this crate calls.
pub struct NcclLibrary {
    lib: SharedLib,
    origin: String,
    code: c_int,
    get_unique_id: FnUniqueId,
    init_rank_config: FnInitConfig,
    async_error: FnAsyncError,
    abort: FnComm,
    finalize: FnComm,
    destroy: FnComm,
    error_string: FnErrorString,
    last_error: FnLastError,
    all_reduce: FnReduceOp,
    broadcast: FnRooted,
    all_gather: FnGather,
    reduce_scatter: FnReduceOp,
    reduce: FnReduce,
    group_start: FnGroup,
    group_end: FnGroup,
}

impl std::fmt::Debug for NcclLibrary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclLibrary")
            .field("path", &self.lib.path())
            .field("version", &self.version())
            .finish()
    }
}

/// Looks `name` up in `lib` as a function of type `F`.
fn function<F: Copy>(lib: &SharedLib, name: &str) -> Result<F, String> {
    let address = lib.symbol(name)?;
    assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<*mut c_void>());
    // SAFETY: F is an `unsafe extern "C" fn` type matching NCCL's declaration of `name`
    // (nccl.h); a function pointer has the size of a data pointer on the supported targets.
    Ok(unsafe { std::mem::transmute_copy::<*mut c_void, F>(&address) })
}

impl NcclLibrary {
    /// Opens the NCCL library at `path` and checks that it is NCCL 2.14 or newer; the error
    /// says what is wrong with the file.
    pub fn open(path: &Path) -> Result<NcclLibrary, String> {
        let lib = SharedLib::open(path)?;
        NcclLibrary::from_lib(lib, "given path".into())
    }

    /// The NCCL library the search finds in `env` (the first file that opens and is new
    /// enough), or why none could be used.
    pub fn find(env: &SearchEnv) -> Result<NcclLibrary, NotFound> {
        let mut not_found = NotFound::new(CudaLibrary::Nccl, env);
        for candidate in find_candidates(CudaLibrary::Nccl, env) {
            match SharedLib::open(&candidate.path)
                .and_then(|lib| NcclLibrary::from_lib(lib, candidate.origin.clone()))
            {
                Ok(nccl) => return Ok(nccl),
                Err(why) => not_found.rejected.push((candidate.path, why)),
            }
        }
        Err(not_found)
    }

    /// [`NcclLibrary::find`], then the dynamic loader's own search by the same names.
    fn find_anywhere(env: &SearchEnv) -> Result<NcclLibrary, String> {
        let mut not_found = match NcclLibrary::find(env) {
            Ok(nccl) => return Ok(nccl),
            Err(e) => e,
        };
        for name in CudaLibrary::Nccl.file_names() {
            if let Ok(lib) = SharedLib::open_by_name(name) {
                let origin = "the dynamic loader's search".to_string();
                return NcclLibrary::from_lib(lib, origin).map_err(|why| {
                    format!("{not_found}; the dynamic loader found {name}, but {why}")
                });
            }
        }
        not_found
            .also
            .push("the dynamic loader's own search (ld.so.cache) has none either".into());
        Err(not_found.to_string())
    }

    fn from_lib(lib: SharedLib, origin: String) -> Result<NcclLibrary, String> {
        let get_version: FnVersion = function(&lib, "ncclGetVersion")?;
        let mut code: c_int = 0;
        // SAFETY: ncclGetVersion writes one int.
        let r = unsafe { get_version(&mut code) };
        if r != NcclResult::SUCCESS {
            return Err(format!("its ncclGetVersion failed ({})", r.name()));
        }
        if code < MIN_VERSION {
            return Err(format!(
                "it is NCCL {}, older than 2.14 (non-blocking communicators)",
                version_text(code)
            ));
        }
        Ok(NcclLibrary {
            get_unique_id: function(&lib, "ncclGetUniqueId")?,
            init_rank_config: function(&lib, "ncclCommInitRankConfig")?,
            async_error: function(&lib, "ncclCommGetAsyncError")?,
            abort: function(&lib, "ncclCommAbort")?,
            finalize: function(&lib, "ncclCommFinalize")?,
            destroy: function(&lib, "ncclCommDestroy")?,
            error_string: function(&lib, "ncclGetErrorString")?,
            last_error: function(&lib, "ncclGetLastError")?,
            all_reduce: function(&lib, "ncclAllReduce")?,
            broadcast: function(&lib, "ncclBroadcast")?,
            all_gather: function(&lib, "ncclAllGather")?,
            reduce_scatter: function(&lib, "ncclReduceScatter")?,
            reduce: function(&lib, "ncclReduce")?,
            group_start: function(&lib, "ncclGroupStart")?,
            group_end: function(&lib, "ncclGroupEnd")?,
            lib,
            origin,
            code,
        })
    }

    /// The file it was opened from.
    pub fn path(&self) -> &Path {
        self.lib.path()
    }

    /// The actual file the loader mapped (for a library found by the loader's own search).
    pub fn file(&self) -> PathBuf {
        self.lib
            .file("ncclGetVersion")
            .unwrap_or_else(|| self.lib.path().to_path_buf())
    }

    /// Where the search found it (`LD_LIBRARY_PATH`, `VIRTUAL_ENV=...`, `system`, ...).
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// Its version, `(major, minor, patch)`.
    pub fn version(&self) -> (u32, u32, u32) {
        let code = self.code.max(0) as u32;
        (code / 10000, (code / 100) % 100, code % 100)
    }

    /// A new unique id (rank 0's, shared through the store).
    pub(crate) fn unique_id(&self) -> Result<UniqueId, NcclResult> {
        let mut id = UniqueId { internal: [0; 128] };
        // SAFETY: writes one id.
        ok(unsafe { (self.get_unique_id)(&mut id) }).map(|_| id)
    }

    /// Starts creating a non-blocking communicator: the result is usually `IN_PROGRESS`, and
    /// [`NcclLibrary::async_error`] says when it is done.
    pub(crate) fn init_rank_nonblocking(
        &self,
        world: usize,
        id: UniqueId,
        rank: usize,
    ) -> (NcclResult, RawComm) {
        let mut config = Config {
            size: std::mem::size_of::<Config>(),
            magic: 0xcafe_beef,
            version: MIN_VERSION as u32,
            blocking: 0,
            _undefined: CONFIG_UNDEFINED,
        };
        let mut comm: RawComm = std::ptr::null_mut();
        // SAFETY: comm receives the communicator; config follows NCCL_CONFIG_INITIALIZER.
        let r = unsafe {
            (self.init_rank_config)(&mut comm, world as c_int, id, rank as c_int, &mut config)
        };
        (r, comm)
    }

    /// The communicator's state: `SUCCESS`, `IN_PROGRESS` (still initialising or enqueueing)
    /// or the error that broke it.
    pub(crate) fn async_error(&self, comm: RawComm) -> NcclResult {
        let mut state = NcclResult::SUCCESS;
        // SAFETY: a live communicator; writes one int.
        let r = unsafe { (self.async_error)(comm, &mut state) };
        if r.is_error() {
            r
        } else {
            state
        }
    }

    /// Aborts the communicator: its kernels end and it is freed (never used again).
    pub(crate) fn abort(&self, comm: RawComm) {
        // SAFETY: a live communicator, not used again.
        let _ = unsafe { (self.abort)(comm) };
    }

    /// Starts finalising the communicator (flushes its work); poll [`NcclLibrary::async_error`].
    pub(crate) fn finalize(&self, comm: RawComm) -> NcclResult {
        // SAFETY: a live communicator.
        unsafe { (self.finalize)(comm) }
    }

    /// Frees a finalised communicator.
    pub(crate) fn destroy(&self, comm: RawComm) -> NcclResult {
        // SAFETY: a live communicator, not used again.
        unsafe { (self.destroy)(comm) }
    }

    /// NCCL's text for `result`, with the communicator's last error message when there is one.
    pub(crate) fn error_text(&self, result: NcclResult, comm: Option<RawComm>) -> String {
        let text = |p: *const c_char| {
            if p.is_null() {
                String::new()
            } else {
                // SAFETY: NCCL returns NUL-terminated strings it owns.
                unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
            }
        };
        // SAFETY: returns a static string.
        let mut message = format!(
            "{} ({})",
            result.name(),
            text(unsafe { (self.error_string)(result) })
        );
        if let Some(comm) = comm.filter(|c| !c.is_null()) {
            // SAFETY: a live communicator; returns a string it owns.
            let last = text(unsafe { (self.last_error)(comm) });
            if !last.is_empty() {
                message.push_str(": ");
                message.push_str(&last);
            }
        }
        message
    }

    /// `ncclAllReduce`, in place when `send == recv`.
    ///
    /// # Safety
    ///
    /// `send` and `recv` hold `count` elements of `dtype` on the communicator's device;
    /// `comm` is live and `stream` belongs to its device.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn all_reduce(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DType,
        op: ReduceOp,
        comm: RawComm,
        stream: RawStream,
    ) -> NcclResult {
        // SAFETY: the caller's promises.
        unsafe {
            (self.all_reduce)(
                send as *const c_void,
                recv as *mut c_void,
                count,
                dtype_code(dtype),
                op_code(op),
                comm,
                stream,
            )
        }
    }

    /// `ncclBroadcast` of `root`'s `count` elements, in place when `send == recv`.
    ///
    /// # Safety
    ///
    /// As [`NcclLibrary::all_reduce`].
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn broadcast(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DType,
        root: usize,
        comm: RawComm,
        stream: RawStream,
    ) -> NcclResult {
        // SAFETY: the caller's promises.
        unsafe {
            (self.broadcast)(
                send as *const c_void,
                recv as *mut c_void,
                count,
                dtype_code(dtype),
                root as c_int,
                comm,
                stream,
            )
        }
    }

    /// `ncclAllGather` of `count` elements per rank into `recv` (world × count).
    ///
    /// # Safety
    ///
    /// As [`NcclLibrary::all_reduce`], with `recv` holding world × `count` elements.
    pub(crate) unsafe fn all_gather(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DType,
        comm: RawComm,
        stream: RawStream,
    ) -> NcclResult {
        // SAFETY: the caller's promises.
        unsafe {
            (self.all_gather)(
                send as *const c_void,
                recv as *mut c_void,
                count,
                dtype_code(dtype),
                comm,
                stream,
            )
        }
    }

    /// `ncclReduceScatter`: `recv_count` elements per rank.
    ///
    /// # Safety
    ///
    /// As [`NcclLibrary::all_reduce`], `send` holding world × `recv_count` elements.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn reduce_scatter(
        &self,
        send: u64,
        recv: u64,
        recv_count: usize,
        dtype: DType,
        op: ReduceOp,
        comm: RawComm,
        stream: RawStream,
    ) -> NcclResult {
        // SAFETY: the caller's promises.
        unsafe {
            (self.reduce_scatter)(
                send as *const c_void,
                recv as *mut c_void,
                recv_count,
                dtype_code(dtype),
                op_code(op),
                comm,
                stream,
            )
        }
    }

    /// `ncclReduce` onto `root` (`recv` is only written there; 0 elsewhere is fine).
    ///
    /// # Safety
    ///
    /// As [`NcclLibrary::all_reduce`].
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn reduce(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DType,
        op: ReduceOp,
        root: usize,
        comm: RawComm,
        stream: RawStream,
    ) -> NcclResult {
        // SAFETY: the caller's promises.
        unsafe {
            (self.reduce)(
                send as *const c_void,
                recv as *mut c_void,
                count,
                dtype_code(dtype),
                op_code(op),
                root as c_int,
                comm,
                stream,
            )
        }
    }

    /// `ncclGroupStart`.
    pub(crate) fn group_start(&self) -> NcclResult {
        // SAFETY: no arguments.
        unsafe { (self.group_start)() }
    }

    /// `ncclGroupEnd`.
    pub(crate) fn group_end(&self) -> NcclResult {
        // SAFETY: no arguments.
        unsafe { (self.group_end)() }
    }
}

/// Ok for success and in-progress, the code otherwise.
pub(crate) fn ok(result: NcclResult) -> Result<NcclResult, NcclResult> {
    if result.is_error() {
        Err(result)
    } else {
        Ok(result)
    }
}

/// `major.minor.patch` of a version code (`major * 10000 + minor * 100 + patch` since 2.9).
fn version_text(code: c_int) -> String {
    let code = code.max(0);
    format!("{}.{}.{}", code / 10000, (code / 100) % 100, code % 100)
}

/// NCCL's data type code (`ncclDataType_t`) for ours.
fn dtype_code(dtype: DType) -> c_int {
    match dtype {
        DType::U8 => 1,
        DType::I32 => 2,
        DType::I64 => 4,
        DType::F16 => 6,
        DType::F32 => 7,
        DType::F64 => 8,
        DType::BF16 => 9,
    }
}

/// NCCL's reduction code (`ncclRedOp_t`) for ours.
fn op_code(op: ReduceOp) -> c_int {
    match op {
        ReduceOp::Sum => 0,
        ReduceOp::Max => 2,
        ReduceOp::Min => 3,
        ReduceOp::Avg => 4,
    }
}

/// The process's NCCL: found once (in the environment the first caller gives, normally the
/// process's own), then the same library for every group.
pub(crate) fn nccl_in(env: &SearchEnv) -> Result<&'static NcclLibrary, String> {
    static NCCL: OnceLock<Result<NcclLibrary, String>> = OnceLock::new();
    NCCL.get_or_init(|| NcclLibrary::find_anywhere(env))
        .as_ref()
        .map_err(Clone::clone)
}

/// [`nccl_in`] the process's environment.
pub(crate) fn nccl() -> Result<&'static NcclLibrary, String> {
    nccl_in(&SearchEnv::from_process())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_match_nccl_h() {
        // The values of nccl.h's enums, as cudarc's generated bindings of NCCL 2.30 have them.
        use cudarc::nccl::sys as nc;
        assert_eq!(
            dtype_code(DType::F32),
            nc::ncclDataType_t::ncclFloat32 as c_int
        );
        assert_eq!(
            dtype_code(DType::BF16),
            nc::ncclDataType_t::ncclBfloat16 as c_int
        );
        assert_eq!(
            dtype_code(DType::F16),
            nc::ncclDataType_t::ncclFloat16 as c_int
        );
        assert_eq!(
            dtype_code(DType::F64),
            nc::ncclDataType_t::ncclFloat64 as c_int
        );
        assert_eq!(
            dtype_code(DType::I32),
            nc::ncclDataType_t::ncclInt32 as c_int
        );
        assert_eq!(
            dtype_code(DType::I64),
            nc::ncclDataType_t::ncclInt64 as c_int
        );
        assert_eq!(
            dtype_code(DType::U8),
            nc::ncclDataType_t::ncclUint8 as c_int
        );
        assert_eq!(op_code(ReduceOp::Sum), nc::ncclRedOp_t::ncclSum as c_int);
        assert_eq!(op_code(ReduceOp::Max), nc::ncclRedOp_t::ncclMax as c_int);
        assert_eq!(op_code(ReduceOp::Min), nc::ncclRedOp_t::ncclMin as c_int);
        assert_eq!(op_code(ReduceOp::Avg), nc::ncclRedOp_t::ncclAvg as c_int);
        assert_eq!(
            NcclResult::IN_PROGRESS.0,
            nc::ncclResult_t::ncclInProgress as c_int
        );
        assert_eq!(
            NcclResult::REMOTE_ERROR.0,
            nc::ncclResult_t::ncclRemoteError as c_int
        );
        // NCCL_CONFIG_INITIALIZER's first fields, as laid out in ncclConfig_v21700.
        assert_eq!(
            std::mem::offset_of!(Config, blocking),
            std::mem::offset_of!(nc::ncclConfig_t, blocking)
        );
        assert_eq!(
            std::mem::offset_of!(Config, version),
            std::mem::offset_of!(nc::ncclConfig_t, version)
        );
    }

    #[test]
    fn a_missing_nccl_is_an_error_naming_the_names() {
        let dir = tempfile::tempdir().unwrap();
        let env = SearchEnv {
            system_dirs: vec![dir.path().to_path_buf()],
            ..SearchEnv::default()
        };
        let e = NcclLibrary::find(&env).unwrap_err().to_string();
        assert!(e.contains("libnccl.so.2, libnccl.so"), "{e}");
    }
}
