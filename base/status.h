// Status / StatusOr: the error model of the tiermem core.
//
// Recoverable failures are returned, never thrown: a Status carries the most specific code
// (tier full = kResourceExhausted, disk trouble = kIOError / kDataLoss, no device =
// kUnavailable, bad user input = kInvalidArgument) and a message written for the user.
// errno is converted in exactly one place (ErrnoToStatus); cudaError_t in tiers/cuda.
// Exceptions appear only at the Python boundary. Thread-safety: values, no shared state.
#pragma once

#include <cassert>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

namespace tiermem {

enum class StatusCode : int {
  kOk = 0,
  kCancelled,
  kInvalidArgument,
  kNotFound,
  kAlreadyExists,
  kFailedPrecondition,
  kOutOfRange,
  kResourceExhausted,
  kUnavailable,
  kUnimplemented,
  kDeadlineExceeded,
  kIOError,
  kDataLoss,
  kInternal,
};

std::string_view StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;  // OK
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }
  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "RESOURCE_EXHAUSTED: device tier: need 4096 bytes, 0 available".
  std::string ToString() const;
  // Returns a copy whose message is "<context>: <message>"; OK stays OK.
  Status WithContext(std::string_view context) const;
  void IgnoreError() const {}

  friend bool operator==(const Status& a, const Status& b) {
    return a.code_ == b.code_ && a.message_ == b.message_;
  }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status OkStatus() { return Status(); }
Status InvalidArgumentError(std::string msg);
Status NotFoundError(std::string msg);
Status AlreadyExistsError(std::string msg);
Status FailedPreconditionError(std::string msg);
Status OutOfRangeError(std::string msg);
Status ResourceExhaustedError(std::string msg);
Status UnavailableError(std::string msg);
Status UnimplementedError(std::string msg);
Status IOError(std::string msg);
Status DataLossError(std::string msg);
Status InternalError(std::string msg);
Status CancelledError(std::string msg);

// The one place errno becomes a Status: ENOSPC/EDQUOT -> kResourceExhausted, EIO -> kIOError,
// EACCES/EPERM/EROFS -> kFailedPrecondition, ENOENT -> kNotFound, EINVAL -> kInvalidArgument,
// ENOMEM -> kResourceExhausted, EOPNOTSUPP/ENOSYS -> kUnimplemented, else kIOError.
// `err` is a positive errno value (io_uring's negative res must be negated by the caller).
Status ErrnoToStatus(int err, std::string_view context);

template <typename T>
class [[nodiscard]] StatusOr {
 public:
  StatusOr(const T& value) : value_(value) {}             // NOLINT(runtime/explicit)
  StatusOr(T&& value) : value_(std::move(value)) {}       // NOLINT(runtime/explicit)
  StatusOr(Status status) : status_(std::move(status)) {  // NOLINT(runtime/explicit)
    assert(!status_.ok() && "StatusOr constructed from an OK status without a value");
    if (status_.ok()) status_ = InternalError("StatusOr constructed from OK status");
  }

  bool ok() const { return value_.has_value(); }
  const Status& status() const { return status_; }
  T& value() & {
    assert(ok());
    return *value_;
  }
  const T& value() const& {
    assert(ok());
    return *value_;
  }
  T&& value() && {
    assert(ok());
    return std::move(*value_);
  }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  Status status_;  // OK iff value_ is set
  std::optional<T> value_;
};

}  // namespace tiermem

#define TIERMEM_CONCAT_INNER_(a, b) a##b
#define TIERMEM_CONCAT_(a, b) TIERMEM_CONCAT_INNER_(a, b)

#define TIERMEM_RETURN_IF_ERROR(expr)                  \
  do {                                                 \
    ::tiermem::Status tiermem_status_ = (expr);        \
    if (!tiermem_status_.ok()) return tiermem_status_; \
  } while (0)

#define TIERMEM_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                   \
  if (!tmp.ok()) return tmp.status();                  \
  lhs = std::move(tmp).value()

#define TIERMEM_ASSIGN_OR_RETURN(lhs, expr) \
  TIERMEM_ASSIGN_OR_RETURN_IMPL_(TIERMEM_CONCAT_(tiermem_statusor_, __LINE__), lhs, expr)
