// Which sanitizer this translation unit is built with (gcc defines __SANITIZE_*__, clang
// answers __has_feature), as constants, so code and tests can adapt without #if ladders: a
// block cache off under ASan (it must see use after free), a deliberately racy test skipped
// under TSan.
#pragma once

#if defined(__SANITIZE_THREAD__)
#define TIERMEM_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define TIERMEM_TSAN 1
#endif
#endif

#if defined(TIERMEM_TSAN)
extern "C" void __tsan_acquire(void* addr);
extern "C" void __tsan_release(void* addr);
#endif

namespace tiermem {

// Happens-before edges TSan cannot see because they pass through an uninstrumented library
// (libtbb: a parallel_for's tasks start after the caller hands them its data and finish
// before parallel_for returns): TsanRelease(&token) on the thread handing over,
// TsanAcquire(&token) on the one taking over. Everything else stays checked. No-ops outside
// TSan builds.
#if defined(TIERMEM_TSAN)
inline void TsanAcquire(void* token) { __tsan_acquire(token); }
inline void TsanRelease(void* token) { __tsan_release(token); }
#else
inline void TsanAcquire(void*) {}
inline void TsanRelease(void*) {}
#endif

#if defined(__SANITIZE_ADDRESS__)
inline constexpr bool kAsanBuild = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
inline constexpr bool kAsanBuild = true;
#else
inline constexpr bool kAsanBuild = false;
#endif
#else
inline constexpr bool kAsanBuild = false;
#endif

#if defined(__SANITIZE_THREAD__)
inline constexpr bool kTsanBuild = true;
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
inline constexpr bool kTsanBuild = true;
#else
inline constexpr bool kTsanBuild = false;
#endif
#else
inline constexpr bool kTsanBuild = false;
#endif

}  // namespace tiermem
