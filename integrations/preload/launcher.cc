// The launcher. Signal forwarding: while the child runs, handlers for the forwarded signals
// send the same signal to the child. A signal the kernel generated for the terminal's
// foreground process group (Ctrl-C: si_code SI_KERNEL) already reached the child, which is in
// the same group, so it is not sent again. Errors of the parent's own calls are converted to
// Status through ErrnoToStatus; an exec failure in the child is reported to the parent through
// a close-on-exec pipe, so "command not found" is an error, not exit code 127 of a shell.
#include "integrations/preload/launcher.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>

extern char** environ;

namespace tiermem::preload {
namespace {

namespace fs = std::filesystem;

bool IsFile(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

constexpr const char* kLibName = "libtiermem_preload.so";

volatile sig_atomic_t g_child = 0;

void Forward(int sig, siginfo_t* info, void*) {
  const pid_t child = g_child;
  if (child <= 0) return;
  if (info != nullptr && info->si_code == SI_KERNEL) return;  // the terminal sent it to the group
  ::kill(child, sig);
}

// The shim options `tiermem run` sets itself; the others pass through from the environment.
bool IsSetByLauncher(const std::string& kv) {
  for (const char* name : {"TIERMEM_PRELOAD_TIMELINE=", "TIERMEM_PRELOAD_EXCLUSIVE=",
                           "TIERMEM_PRELOAD_OFFLOAD=", "TIERMEM_PRELOAD_DEVICE_BUDGET="}) {
    if (kv.rfind(name, 0) == 0) return true;
  }
  return false;
}

constexpr int kForwarded[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2};

std::string Absolute(const std::string& p) {
  std::error_code ec;
  fs::path abs = fs::absolute(p, ec);
  return ec ? p : abs.lexically_normal().string();
}

}  // namespace

StatusOr<std::string> FindPreloadLibrary(const EnvGetter& env, const std::string& exe_path,
                                         const std::string& build_path) {
  if (const char* v = env("TIERMEM_PRELOAD_LIB"); v != nullptr && v[0] != '\0') {
    if (IsFile(v)) return std::string(v);
    return NotFoundError(std::string("TIERMEM_PRELOAD_LIB='") + v + "' is not a file");
  }
  std::vector<std::string> tried;
  if (!exe_path.empty()) {
    const fs::path dir = fs::path(exe_path).parent_path();
    tried.push_back((dir / kLibName).string());
    tried.push_back((dir / ".." / "lib" / kLibName).lexically_normal().string());
  }
  if (!build_path.empty()) tried.push_back(build_path);
  for (const std::string& p : tried) {
    if (IsFile(p)) return p;
  }
  std::string list;
  for (const std::string& p : tried) list += (list.empty() ? "" : ", ") + p;
  return NotFoundError(std::string(kLibName) +
                       " not found (set TIERMEM_PRELOAD_LIB); looked at: " + list);
}

StatusOr<std::string> FindPreloadLibrary() {
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
#ifdef TIERMEM_PRELOAD_BUILD_PATH
  const std::string build = TIERMEM_PRELOAD_BUILD_PATH;
#else
  const std::string build;
#endif
  return FindPreloadLibrary(ProcessEnv(), ec ? std::string() : exe.string(), build);
}

StatusOr<std::vector<std::string>> ChildEnvironment(const RunOptions& o, const std::string& lib,
                                                    const std::vector<std::string>& parent) {
  if (o.offload && o.device_budget == 0) {
    return InvalidArgumentError("--offload needs --device-budget (e.g. --device-budget 16GiB)");
  }
  if (!o.offload && o.device_budget != 0) {
    return InvalidArgumentError("--device-budget is only used with --offload");
  }
  std::vector<std::string> env;
  std::string preload, alloc_conf;
  bool have_conf = false;
  for (const std::string& kv : parent) {
    if (kv.rfind("LD_PRELOAD=", 0) == 0) {
      preload = kv.substr(11);
    } else if (kv.rfind("PYTORCH_CUDA_ALLOC_CONF=", 0) == 0) {
      alloc_conf = kv.substr(24);
      have_conf = true;
    } else if (IsSetByLauncher(kv)) {
      continue;  // replaced by the launcher's own values below
    } else {
      env.push_back(kv);
    }
  }
  env.push_back("LD_PRELOAD=" + (preload.empty() ? lib : preload + ":" + lib));
  env.push_back("TIERMEM_PRELOAD_TIMELINE=" +
                (o.record_path.empty() ? "" : Absolute(o.record_path)));
  env.push_back("TIERMEM_PRELOAD_EXCLUSIVE=1");
  env.push_back(std::string("TIERMEM_PRELOAD_OFFLOAD=") + (o.offload ? "1" : "0"));
  if (o.offload) env.push_back("TIERMEM_PRELOAD_DEVICE_BUDGET=" + std::to_string(o.device_budget));
  if (o.per_tensor) {
    if (alloc_conf.find("backend:") != std::string::npos &&
        alloc_conf.find("backend:cudaMallocAsync") == std::string::npos) {
      return InvalidArgumentError(
          "--per-tensor sets PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync, "
          "but it already says '" +
          alloc_conf + "'");
    }
    if (alloc_conf.find("backend:cudaMallocAsync") == std::string::npos) {
      alloc_conf =
          alloc_conf.empty() ? "backend:cudaMallocAsync" : alloc_conf + ",backend:cudaMallocAsync";
    }
    have_conf = true;
  }
  if (have_conf) env.push_back("PYTORCH_CUDA_ALLOC_CONF=" + alloc_conf);
  return env;
}

StatusOr<int> RunCommand(const RunOptions& o, const std::vector<std::string>& env) {
  if (o.command.empty()) return InvalidArgumentError("no command to run (tiermem run -- CMD ...)");
  std::vector<char*> argv, envp;
  for (const std::string& a : o.command) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  for (const std::string& e : env) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);

  int err_pipe[2];
  if (::pipe2(err_pipe, O_CLOEXEC) != 0) return ErrnoToStatus(errno, "tiermem run: pipe");
  struct sigaction forward = {}, old[std::size(kForwarded)];
  forward.sa_sigaction = Forward;
  forward.sa_flags = SA_SIGINFO | SA_RESTART;
  sigemptyset(&forward.sa_mask);
  for (size_t i = 0; i < std::size(kForwarded); ++i) sigaction(kForwarded[i], &forward, &old[i]);
  // The forwarded signals stay blocked from before the fork until g_child names the child: one
  // that arrives in between (the child can exec and answer before this process runs again) is
  // held pending and forwarded then, never dropped.
  sigset_t forwarded, unblocked;
  sigemptyset(&forwarded);
  for (int sig : kForwarded) sigaddset(&forwarded, sig);
  ::sigprocmask(SIG_BLOCK, &forwarded, &unblocked);

  const pid_t pid = ::fork();
  if (pid < 0) {
    const int e = errno;
    ::sigprocmask(SIG_SETMASK, &unblocked, nullptr);
    for (size_t i = 0; i < std::size(kForwarded); ++i) sigaction(kForwarded[i], &old[i], nullptr);
    ::close(err_pipe[0]);
    ::close(err_pipe[1]);
    return ErrnoToStatus(e, "tiermem run: fork");
  }
  if (pid == 0) {
    // Caught signals revert to their default on exec; restore the parent's ignored ones too.
    for (size_t i = 0; i < std::size(kForwarded); ++i) sigaction(kForwarded[i], &old[i], nullptr);
    ::sigprocmask(SIG_SETMASK, &unblocked, nullptr);  // the command starts with the caller's mask
    ::close(err_pipe[0]);
    ::execvpe(argv[0], argv.data(), envp.data());
    const int e = errno;
    ssize_t w = ::write(err_pipe[1], &e, sizeof(e));
    (void)w;
    ::_exit(127);
  }
  g_child = pid;
  ::sigprocmask(SIG_SETMASK, &unblocked, nullptr);  // a signal held meanwhile is forwarded now
  ::close(err_pipe[1]);
  int exec_errno = 0;
  ssize_t n;
  do {
    n = ::read(err_pipe[0], &exec_errno, sizeof(exec_errno));
  } while (n < 0 && errno == EINTR);
  ::close(err_pipe[0]);

  int status = 0;
  pid_t w;
  do {
    w = ::waitpid(pid, &status, 0);
  } while (w < 0 && errno == EINTR);
  g_child = 0;
  for (size_t i = 0; i < std::size(kForwarded); ++i) sigaction(kForwarded[i], &old[i], nullptr);
  if (n == static_cast<ssize_t>(sizeof(exec_errno))) {
    return ErrnoToStatus(exec_errno, "tiermem run: cannot run '" + o.command[0] + "'");
  }
  if (w < 0) return ErrnoToStatus(errno, "tiermem run: waitpid");
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return InternalError("tiermem run: unexpected wait status " + std::to_string(status));
}

std::vector<std::string> TimelinesWritten(const std::string& record_path, long long since_s) {
  std::vector<std::string> out;
  if (record_path.empty()) return out;
  const fs::path p = Absolute(record_path);
  std::error_code ec;
  auto fresh = [&](const fs::path& f) {
    struct stat st;
    return ::stat(f.c_str(), &st) == 0 && S_ISREG(st.st_mode) && st.st_mtime >= since_s;
  };
  if (fresh(p)) out.push_back(p.string());
  const std::string stem = p.stem().string() + ".", ext = p.extension().string();
  for (const auto& entry : fs::directory_iterator(p.parent_path(), ec)) {
    const std::string name = entry.path().filename().string();
    if (name.size() <= stem.size() + ext.size() || name.rfind(stem, 0) != 0) continue;
    if (name.compare(name.size() - ext.size(), ext.size(), ext) != 0) continue;
    const std::string mid = name.substr(stem.size(), name.size() - stem.size() - ext.size());
    if (mid.find_first_not_of("0123456789") != std::string::npos) continue;
    if (fresh(entry.path())) out.push_back(entry.path().string());
  }
  return out;
}

StatusOr<int> RunWithPreload(const RunOptions& o) {
  TIERMEM_ASSIGN_OR_RETURN(const std::string lib, FindPreloadLibrary());
  std::vector<std::string> parent;
  for (char** e = environ; *e != nullptr; ++e) parent.emplace_back(*e);
  TIERMEM_ASSIGN_OR_RETURN(std::vector<std::string> env, ChildEnvironment(o, lib, parent));
  if (!o.record_path.empty()) {
    // The first process of the job claims the path with O_EXCL (see the shim), so an old
    // file must go first.
    if (::unlink(o.record_path.c_str()) != 0 && errno != ENOENT) {
      return ErrnoToStatus(errno, "tiermem run: cannot replace " + o.record_path);
    }
  }
  const long long start = static_cast<long long>(::time(nullptr));
  TIERMEM_ASSIGN_OR_RETURN(const int code, RunCommand(o, env));
  if (code > 128 && code < 128 + 65) {
    std::fprintf(stderr, "tiermem run: the command was killed by signal %d (%s)\n", code - 128,
                 strsignal(code - 128));
  }
  if (!o.record_path.empty()) {
    const std::vector<std::string> written = TimelinesWritten(o.record_path, start);
    if (written.empty()) {
      std::fprintf(stderr,
                   "tiermem run: no timeline: %s was not created (the command made no "
                   "CUDA call, or the shim could not write it: see its lines above)\n",
                   o.record_path.c_str());
    }
    for (const std::string& t : written) {
      std::fprintf(stderr, "tiermem run: timeline written to %s (tiermem prof report %s)\n",
                   t.c_str(), t.c_str());
    }
  }
  return code;
}

}  // namespace tiermem::preload
