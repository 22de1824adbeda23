// Helpers the session tests share.
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "runtime/session.h"
#include "tests/support/status_matchers.h"

namespace tiermem::session {

// Writes fp32 `g` into the tensor's grad span on the compute tier (as a binding's backward
// does: rounded to the grad dtype) and marks it.
inline void SetGrad(Session& s, size_t t, const std::vector<float>& g) {
  const TensorPlace& p = s.layout().place(t);
  auto base = s.chunks().Acquire(p.group, ChunkKind::kGrad, s.placement().compute_tier());
  ASSERT_TRUE(base.ok()) << base.status().ToString();
  if (s.layout().dtype(ChunkKind::kGrad) == kernels::DType::kF32) {
    std::memcpy(static_cast<float*>(*base) + p.offset, g.data(), g.size() * 4);
  } else {
    kernels::CastFromF32(g.data(), static_cast<char*>(*base) + p.offset * 2,
                         s.layout().dtype(ChunkKind::kGrad), g.size());
  }
  ASSERT_THAT(s.chunks().Release(p.group, ChunkKind::kGrad, true), ::tiermem::testing::IsOk());
  s.optimizer().SetHasGrad(t, true);
}

}  // namespace tiermem::session
