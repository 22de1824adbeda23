// gmock matchers for Status / StatusOr, so tests read like specs:
//   EXPECT_THAT(session->Step(hyper), StatusIs(StatusCode::kInvalidArgument, "eps"));
//   ASSERT_THAT(s, IsOk());
// StatusIs matches a Status or a StatusOr<T> whose code equals `code` and whose message
// contains `substring` (empty: any message). Failures print the whole status.
#pragma once

#include <gmock/gmock.h>

#include <string>

#include "base/status.h"

namespace tiermem::testing {

inline const Status& GetStatus(const Status& s) { return s; }
template <typename T>
const Status& GetStatus(const StatusOr<T>& s) {
  return s.status();
}

MATCHER_P2(StatusIs, code, substring,
           std::string("has code ") + std::string(StatusCodeName(code)) + " and a message "
               "containing \"" + std::string(substring) + "\"") {
  const Status& s = ::tiermem::testing::GetStatus(arg);
  *result_listener << "which is " << s.ToString();
  return s.code() == code && s.message().find(substring) != std::string::npos;
}

MATCHER(IsOk, "is OK") {
  const Status& s = ::tiermem::testing::GetStatus(arg);
  *result_listener << "which is " << s.ToString();
  return s.ok();
}

}  // namespace tiermem::testing
