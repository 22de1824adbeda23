#include "base/fs.h"

#include <errno.h>
#include <sys/stat.h>

#include <cstring>

namespace tiermem {

Status MakeDirs(const std::string& dir) {
  if (dir.empty()) return OkStatus();
  std::string prefix;
  size_t pos = 0;
  while (pos != std::string::npos) {
    pos = dir.find('/', pos + 1);
    prefix = dir.substr(0, pos);
    if (prefix.empty()) continue;
    if (mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST) {
      return IOError("cannot create directory '" + prefix + "': " + std::strerror(errno));
    }
  }
  struct stat st;
  if (stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return IOError("'" + dir + "' is not a directory");
  }
  return OkStatus();
}

std::string DirName(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return "";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

}  // namespace tiermem
