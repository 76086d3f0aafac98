//! The process's allocator settings (glibc malloc): how many arenas it may
//! keep, and handing freed pages back to the system. It owns only these two
//! calls, which take no outside data; it must never allocate for others nor
//! decide anything about the fleet.

/// Keeps glibc to one malloc arena, for the whole process. Called first in
/// `main`, before the runtime starts its threads. By default glibc gives
/// threads their own arenas (up to 8 per core), and each keeps its own free
/// pages and fragments: at 10,000 machines `check` peaked 5–8 MiB higher
/// (about a tenth) with them (#22). The threads here spend their time on
/// sockets and git, not in malloc, so sharing one arena costs little.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
// mallopt(3) has no safe wrapper.
#[allow(unsafe_code)]
pub fn one_arena() {
    // SAFETY: mallopt takes two integers and touches no memory of ours; a
    // refused setting leaves glibc's default, which is only more memory.
    unsafe { libc::mallopt(libc::M_ARENA_MAX, 1) };
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn one_arena() {}

/// Hands the heap pages a sweep freed back to the system. A sweep of
/// 10,000 machines allocates and frees hundreds of MiB (listings, probes,
/// rows); glibc keeps freed pages in its arenas, so without this the
/// resident size ratchets up to the largest sweep's high-water mark plus
/// fragmentation (the soak bench, #22: +33 % against +20 % with it, at
/// 2,000 machines). It only releases free memory; it takes milliseconds
/// once per sweep.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
// malloc_trim(3) has no safe wrapper.
#[allow(unsafe_code)]
pub fn return_freed_memory() {
    // SAFETY: malloc_trim takes no pointer and touches only free chunks.
    unsafe { libc::malloc_trim(0) };
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn return_freed_memory() {}
