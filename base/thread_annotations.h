// Thread-safety annotations that clang's -Wthread-safety checks at compile time: which mutex
// guards a member, which functions must (or must not) be called with it held, which acquire or
// release it. Under other compilers they expand to nothing. CI's TSan build runs clang with
// -Werror=thread-safety (the TIERMEM_THREAD_SAFETY CMake option), so a member touched without
// its mutex fails the build. The capabilities themselves are base/mutex.h.
//
//   Mutex mu_;
//   int count_ TIERMEM_GUARDED_BY(mu_) = 0;   // the member itself needs mu_
//   char* buf_ TIERMEM_PT_GUARDED_BY(mu_);    // what it points to needs mu_
//   void BumpLocked() TIERMEM_REQUIRES(mu_);  // callers hold mu_
//   void Bump() TIERMEM_EXCLUDES(mu_);        // callers must not (it takes mu_ itself)
//
// TIERMEM_NO_THREAD_SAFETY_ANALYSIS turns the check off for one function: a last resort, with
// a comment saying why the locking is right anyway.
#pragma once

#if defined(__clang__)
#define TIERMEM_THREAD_ANNOTATION_(x) __attribute__((x))
#else
#define TIERMEM_THREAD_ANNOTATION_(x)
#endif

#define TIERMEM_CAPABILITY(name) TIERMEM_THREAD_ANNOTATION_(capability(name))
#define TIERMEM_SCOPED_CAPABILITY TIERMEM_THREAD_ANNOTATION_(scoped_lockable)
#define TIERMEM_GUARDED_BY(mu) TIERMEM_THREAD_ANNOTATION_(guarded_by(mu))
#define TIERMEM_PT_GUARDED_BY(mu) TIERMEM_THREAD_ANNOTATION_(pt_guarded_by(mu))
#define TIERMEM_REQUIRES(...) TIERMEM_THREAD_ANNOTATION_(requires_capability(__VA_ARGS__))
#define TIERMEM_EXCLUDES(...) TIERMEM_THREAD_ANNOTATION_(locks_excluded(__VA_ARGS__))
#define TIERMEM_ACQUIRE(...) TIERMEM_THREAD_ANNOTATION_(acquire_capability(__VA_ARGS__))
#define TIERMEM_RELEASE(...) TIERMEM_THREAD_ANNOTATION_(release_capability(__VA_ARGS__))
#define TIERMEM_RETURN_CAPABILITY(mu) TIERMEM_THREAD_ANNOTATION_(lock_returned(mu))
#define TIERMEM_NO_THREAD_SAFETY_ANALYSIS TIERMEM_THREAD_ANNOTATION_(no_thread_safety_analysis)
