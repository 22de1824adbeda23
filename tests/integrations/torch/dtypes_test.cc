// integrations/torch/cpp/dtypes.h: the one torch <-> core dtype map both bindings use.
#include "integrations/torch/cpp/dtypes.h"

#include <gtest/gtest.h>

namespace tiermem::torch_dtypes {
namespace {

TEST(TorchDTypes, EveryCoreTypeRoundTripsWithItsElementSize) {
  for (kernels::DType d : {kernels::DType::kF32, kernels::DType::kBF16, kernels::DType::kF16}) {
    const c10::ScalarType t = TorchDType(d);
    ASSERT_EQ(CoreDType(t), d) << c10::toString(t);
    EXPECT_EQ(c10::elementSize(t), kernels::DTypeSize(d)) << c10::toString(t);
  }
  EXPECT_EQ(TorchDType(kernels::DType::kF32), c10::ScalarType::Float);
  EXPECT_EQ(TorchDType(kernels::DType::kBF16), c10::ScalarType::BFloat16);
  EXPECT_EQ(TorchDType(kernels::DType::kF16), c10::ScalarType::Half);
}

TEST(TorchDTypes, TypesWithoutKernelsHaveNoCoreType) {
  for (c10::ScalarType t : {c10::ScalarType::Double, c10::ScalarType::Int, c10::ScalarType::Byte,
                            c10::ScalarType::Bool, c10::ScalarType::Float8_e4m3fn}) {
    EXPECT_EQ(CoreDType(t), std::nullopt) << c10::toString(t);
  }
}

}  // namespace
}  // namespace tiermem::torch_dtypes
