#include "tools/bench/hugepage_lease.h"

#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/file.h>
#include <sys/mount.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

namespace tiermem::tools {
namespace {

constexpr const char* kNrHugepages = "/proc/sys/vm/nr_hugepages";
// Serializes leases across processes: a lease counts the free pages as its own.
constexpr const char* kLockPath = "/tmp/tiermem-bench-hugepages.lock";
constexpr int kSignals[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT};
constexpr int kNumSignals = sizeof(kSignals) / sizeof(kSignals[0]);

// What a signal handler must undo. Written only with kSignals blocked, so the handler never
// sees it half-written; read by the handler with async-signal-safe calls only.
struct SignalUndo {
  char mount[256] = {};  // non-empty: a hugetlbfs this process mounted (and its directory)
  long added_pages = 0;  // pages this process added to vm.nr_hugepages
  char scratch[1024] = {};
  pid_t child = 0;
};
SignalUndo g_undo;
struct sigaction g_previous[kNumSignals];
// The thread that installed the handlers: the bench's own, which waits for fio. The undoing runs
// there only — on another thread (an I/O or kernel worker the signal happened to reach), the
// bench's thread would see fio killed under it and exit 1 with an error while the handler
// still undoes, racing its raise (the CI flake of test_a_signal_mid_run...).
pthread_t g_owner;

// Blocks kSignals for its lifetime.
class SignalsBlocked {
 public:
  SignalsBlocked() {
    sigset_t set;
    sigemptyset(&set);
    for (int s : kSignals) sigaddset(&set, s);
    sigprocmask(SIG_BLOCK, &set, &old_);
  }
  ~SignalsBlocked() { sigprocmask(SIG_SETMASK, &old_, nullptr); }

 private:
  sigset_t old_;
};

// Async-signal-safe reads and writes of a number in a /proc file.
bool ReadLong(const char* path, long* value) {
  const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  char buf[32];
  const ssize_t n = ::read(fd, buf, sizeof(buf) - 1);
  ::close(fd);
  if (n <= 0) return false;
  long v = 0;
  for (ssize_t i = 0; i < n && buf[i] >= '0' && buf[i] <= '9'; ++i) v = v * 10 + (buf[i] - '0');
  *value = v;
  return true;
}
bool WriteLong(const char* path, long value) {
  char digits[24];
  int n = 0;
  do {
    digits[n++] = static_cast<char>('0' + value % 10);
    value /= 10;
  } while (value > 0 && n < 23);
  char buf[24];
  for (int i = 0; i < n; ++i) buf[i] = digits[n - 1 - i];
  const int fd = ::open(path, O_WRONLY | O_CLOEXEC);
  if (fd < 0) return false;
  const bool ok = ::write(fd, buf, n) == n;
  ::close(fd);
  return ok;
}

// Undoes what g_undo records. Async-signal-safe.
void UndoRecorded() {
  if (g_undo.mount[0] != '\0') {
    ::umount2(g_undo.mount, MNT_DETACH);  // detaches even while a killed fio still maps a file
    ::rmdir(g_undo.mount);
    g_undo.mount[0] = '\0';
  }
  if (g_undo.added_pages > 0) {
    long now;
    if (ReadLong(kNrHugepages, &now)) {
      WriteLong(kNrHugepages, now > g_undo.added_pages ? now - g_undo.added_pages : 0);
    }
    g_undo.added_pages = 0;
  }
}

void OnSignal(int sig) {
  if (!pthread_equal(pthread_self(), g_owner)) {
    ::pthread_kill(g_owner, sig);  // async-signal-safe; pending there while it blocks signals
    return;
  }
  if (g_undo.child > 0) {
    ::kill(g_undo.child, SIGTERM);
    ::waitpid(g_undo.child, nullptr, 0);  // its huge pages are free once it is gone
  }
  if (g_undo.scratch[0] != '\0') ::unlink(g_undo.scratch);
  UndoRecorded();
  // The disposition the process had, then the signal again: it ends as it would have.
  for (int i = 0; i < kNumSignals; ++i) {
    if (kSignals[i] == sig) ::sigaction(sig, &g_previous[i], nullptr);
  }
  ::raise(sig);
}

struct Meminfo {
  long free_pages = 0;      // HugePages_Free
  long reserved_pages = 0;  // HugePages_Rsvd: free but promised to a mapping
  Bytes page_bytes = 0;     // Hugepagesize
};
Meminfo ReadMeminfo() {
  Meminfo m;
  std::ifstream f("/proc/meminfo");
  std::string line;
  while (std::getline(f, line)) {
    long v = 0;
    if (std::sscanf(line.c_str(), "HugePages_Free: %ld", &v) == 1) m.free_pages = v;
    if (std::sscanf(line.c_str(), "HugePages_Rsvd: %ld", &v) == 1) m.reserved_pages = v;
    if (std::sscanf(line.c_str(), "Hugepagesize: %ld kB", &v) == 1) m.page_bytes = v * kKiB;
  }
  return m;
}

// A writable hugetlbfs mount of the default huge page size, or "".
std::string FindHugetlbfs(Bytes page_bytes) {
  std::ifstream f("/proc/mounts");
  std::string line;
  const std::string want_size = "pagesize=" + std::to_string(page_bytes / kMiB) + "M";
  while (std::getline(f, line)) {
    std::istringstream in(line);
    std::string dev, dir, type, opts;
    in >> dev >> dir >> type >> opts;
    if (type != "hugetlbfs") continue;
    if (opts.find("pagesize=") != std::string::npos && opts.find(want_size) == std::string::npos) {
      continue;
    }
    if (("," + opts + ",").find(",ro,") != std::string::npos) continue;
    if (::access(dir.c_str(), W_OK) == 0) return dir;
  }
  return "";
}

void CopyInto(char* dst, size_t cap, const std::string& s) {
  const size_t n = std::min(cap - 1, s.size());
  std::memcpy(dst, s.data(), n);
  dst[n] = '\0';
}

}  // namespace

std::unique_ptr<HugePageLease> HugePageLease::Acquire(Bytes bytes) {
  std::unique_ptr<HugePageLease> lease(new HugePageLease);
  lease->InstallHandlers();  // before anything changes; each change is recorded with them blocked
  lease->lock_fd_ = ::open(kLockPath, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
  if (lease->lock_fd_ >= 0) {
    while (::flock(lease->lock_fd_, LOCK_EX) != 0 && errno == EINTR) {
    }
  }
  Meminfo m = ReadMeminfo();
  if (m.page_bytes == 0) {
    lease->description_ = "no huge pages: this kernel has no hugetlb pool";
    return lease;
  }
  const long need = static_cast<long>((bytes + m.page_bytes - 1) / m.page_bytes);
  const std::string page = FormatBytes(m.page_bytes);
  long before = 0;
  (void)ReadLong(kNrHugepages, &before);
  if (m.free_pages - m.reserved_pages < need) {
    const long missing = need - (m.free_pages - m.reserved_pages);
    {
      SignalsBlocked blocked;
      long now = before;
      if (WriteLong(kNrHugepages, before + missing)) (void)ReadLong(kNrHugepages, &now);
      lease->added_pages_ = now > before ? now - before : 0;
      g_undo.added_pages = lease->added_pages_;
    }
    m = ReadMeminfo();
    if (m.free_pages - m.reserved_pages < need) {
      const long got = lease->added_pages_;
      lease->GiveBack();
      lease->description_ =
          got == 0 ? "no huge pages: " + std::to_string(m.free_pages - m.reserved_pages) +
                         " of the " + std::to_string(need) + " " + page +
                         " pages needed are free, and vm.nr_hugepages is not writable here (as "
                         "root the bench raises it for the run)"
                   : "no huge pages: the kernel gave " + std::to_string(got) + " of the " +
                         std::to_string(missing) + " " + page +
                         " pages asked for (memory too fragmented); undone";
      return lease;
    }
  }
  lease->ok_ = true;
  lease->mount_ = FindHugetlbfs(m.page_bytes);
  if (lease->mount_.empty() && ::geteuid() == 0) {
    char dir[] = "/tmp/tiermem-hugetlbfs-XXXXXX";
    if (::mkdtemp(dir) != nullptr) {
      SignalsBlocked blocked;
      if (::mount("tiermem-bench", dir, "hugetlbfs", 0, nullptr) == 0) {
        lease->mount_ = dir;
        lease->mounted_ = true;
        CopyInto(g_undo.mount, sizeof(g_undo.mount), dir);
      } else {
        ::rmdir(dir);
      }
    }
  }
  std::string d = "huge pages: " + std::to_string(need) + " " + page + " pages";
  if (lease->added_pages_ > 0) {
    d += ", vm.nr_hugepages raised " + std::to_string(before) + " -> " +
         std::to_string(before + lease->added_pages_) + " for this run";
  } else {
    d += " already free";
  }
  d += lease->mount_.empty() ? "; no hugetlbfs (anonymous huge pages)"
       : lease->mounted_     ? "; hugetlbfs mounted at " + lease->mount_ + " for this run"
                             : "; hugetlbfs at " + lease->mount_;
  if (lease->set_up_anything()) d += " (undone at exit, also on SIGINT/SIGTERM)";
  lease->description_ = d;
  return lease;
}

void HugePageLease::InstallHandlers() {
  g_owner = pthread_self();
  for (int i = 0; i < kNumSignals; ++i) {
    // A signal ignored when the bench started (a background job's SIGINT, nohup's SIGHUP)
    // stays ignored: catching it would undo the lease under a run that goes on.
    ::sigaction(kSignals[i], nullptr, &g_previous[i]);
    if (g_previous[i].sa_handler == SIG_IGN) continue;
    struct sigaction sa {};
    sa.sa_handler = OnSignal;
    sigemptyset(&sa.sa_mask);
    for (int s : kSignals) sigaddset(&sa.sa_mask, s);
    ::sigaction(kSignals[i], &sa, &g_previous[i]);
  }
}

void HugePageLease::GiveBack() {
  {
    SignalsBlocked blocked;
    UndoRecorded();
  }
  added_pages_ = 0;
  mounted_ = false;
}

HugePageLease::~HugePageLease() {
  GiveBack();
  {
    SignalsBlocked blocked;
    g_undo.scratch[0] = '\0';
    g_undo.child = 0;
  }
  for (int i = 0; i < kNumSignals; ++i) ::sigaction(kSignals[i], &g_previous[i], nullptr);
  if (lock_fd_ >= 0) ::close(lock_fd_);  // releases the lock
}

void HugePageLease::SetChild(pid_t pid) {
  SignalsBlocked blocked;
  g_undo.child = pid;
}

void HugePageLease::SetScratchFile(const std::string& path) {
  SignalsBlocked blocked;
  CopyInto(g_undo.scratch, sizeof(g_undo.scratch), path);
}

}  // namespace tiermem::tools
