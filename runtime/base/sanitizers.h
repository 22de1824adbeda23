// Which sanitizer this translation unit is built with (gcc defines __SANITIZE_*__, clang
// answers __has_feature), as constants, so code and tests can adapt without #if ladders: a
// block cache off under ASan (it must see use after free), a deliberately racy test skipped
// under TSan.
#pragma once

namespace tiermem {

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
