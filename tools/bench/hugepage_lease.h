// Huge pages for a benchmark's buffers, set up for the run and undone after it.
//
// `tiermem bench nvme` compares the NVMe tier with fio given the same advantages; one of them
// is huge-page-backed buffers (fio's `--iomem=mmaphuge`), which needs free hugetlb pages and,
// for fio's file-backed variant, a mounted hugetlbfs. Most machines have neither. A
// HugePageLease makes `bytes` of hugetlb pages free for this process: what the machine lacks it
// sets up when the process may (root) — it raises vm.nr_hugepages by the missing pages and
// mounts a hugetlbfs on a fresh directory when none is mounted — and it undoes exactly that,
// on destruction and from a handler of SIGINT, SIGTERM, SIGHUP and SIGQUIT (which then stops
// the benchmark's child process and lets the signal end this one as it would have). Leases are
// exclusive across processes (an advisory lock), so two benchmarks never count each other's
// pages as free.
//
// Threading: at most one lease per process; not thread-safe.
#pragma once

#include <sys/types.h>

#include <memory>
#include <string>

#include "base/units.h"

namespace tiermem::tools {

class HugePageLease {
 public:
  // Never fails: when the pages cannot be had, ok() is false and Describe() says why.
  static std::unique_ptr<HugePageLease> Acquire(Bytes bytes);
  ~HugePageLease();  // undoes what Acquire set up, restores the signal dispositions
  HugePageLease(const HugePageLease&) = delete;
  HugePageLease& operator=(const HugePageLease&) = delete;

  bool ok() const { return ok_; }  // `bytes` of hugetlb pages are free for this run
  // A writable hugetlbfs mount point, or empty (then map anonymous huge pages).
  const std::string& mount() const { return mount_; }
  // One line: what was there, what this lease set up, or why there are no huge pages.
  const std::string& Describe() const { return description_; }
  // Whether this lease changed the machine (pages added or a hugetlbfs mounted).
  bool set_up_anything() const { return added_pages_ > 0 || mounted_; }
  long added_pages() const { return added_pages_; }
  bool mounted() const { return mounted_; }

  // While a lease is held, a signal that ends the process first sends SIGTERM to `pid` (the
  // running fio; 0 = none) and deletes `path` (its data file; "" = none), so neither outlives
  // the run.
  static void SetChild(pid_t pid);
  static void SetScratchFile(const std::string& path);

 private:
  HugePageLease() = default;
  void InstallHandlers();
  void GiveBack();  // undoes what Acquire set up (the handlers stay)

  int lock_fd_ = -1;
  bool ok_ = false;
  std::string mount_;
  bool mounted_ = false;  // this lease mounted mount_ (and created its directory)
  long added_pages_ = 0;  // pages this lease added to vm.nr_hugepages
  std::string description_;
};

}  // namespace tiermem::tools
