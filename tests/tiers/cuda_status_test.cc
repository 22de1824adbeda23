// cudaError_t -> Status mapping, and the CUDA tier's behaviour without a GPU (label cpu: this
// runs everywhere; on a GPU machine the no-GPU expectations are skipped).
#include <gtest/gtest.h>

#include <vector>

#include "tiers/cuda/cuda_status.h"
#include "tiers/cuda/cuda_tier.h"

namespace tiermem {
namespace {

TEST(CudaStatus, MapsErrorsToSpecificCodes) {
  EXPECT_TRUE(CudaErrorToStatus(cudaSuccess, "x").ok());
  for (cudaError_t e : {cudaErrorInsufficientDriver, cudaErrorNoDevice}) {
    const Status s = CudaErrorToStatus(e, "probe");
    EXPECT_EQ(s.code(), StatusCode::kUnavailable);
    EXPECT_NE(s.message().find("no CUDA device"), std::string::npos) << s.message();
    EXPECT_EQ(s.message().rfind("probe: ", 0), 0u) << s.message();
  }
  EXPECT_EQ(CudaErrorToStatus(cudaErrorMemoryAllocation, "m").code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(CudaErrorToStatus(cudaErrorInvalidValue, "m").code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(CudaErrorToStatus(cudaErrorHostMemoryAlreadyRegistered, "m").code(),
            StatusCode::kAlreadyExists);
  EXPECT_EQ(CudaErrorToStatus(cudaErrorHostMemoryNotRegistered, "m").code(),
            StatusCode::kFailedPrecondition);
  EXPECT_EQ(CudaErrorToStatus(cudaErrorECCUncorrectable, "m").code(), StatusCode::kDataLoss);
  const Status other = CudaErrorToStatus(cudaErrorLaunchFailure, "launch");
  EXPECT_EQ(other.code(), StatusCode::kInternal);
  EXPECT_NE(other.message().find("cudaErrorLaunchFailure"), std::string::npos) << other.message();
}

TEST(CudaTierWithoutGpu, CreationIsUnavailable) {
  if (CudaDeviceCount().ok()) GTEST_SKIP() << "a GPU is present";
  const Status count = CudaDeviceCount().status();
  EXPECT_EQ(count.code(), StatusCode::kUnavailable) << count.ToString();
  StatusOr<std::unique_ptr<Tier>> tier = NewCudaTier(CudaTierConfig{});
  ASSERT_FALSE(tier.ok());
  EXPECT_EQ(tier.status().code(), StatusCode::kUnavailable) << tier.status().ToString();
  EXPECT_NE(tier.status().message().find("no CUDA device"), std::string::npos);
  std::vector<char> buf(4096);
  EXPECT_EQ(CudaHostRegister(buf.data(), buf.size()).code(), StatusCode::kUnavailable);
  EXPECT_EQ(CudaHostRegistration::Make(buf.data(), buf.size()).status().code(),
            StatusCode::kUnavailable);
}

TEST(CudaTierConfigCheck, BadConfigIsInvalidArgumentBeforeTouchingTheDevice) {
  CudaTierConfig c;
  c.alignment = 100;
  EXPECT_EQ(NewCudaTier(c).status().code(), StatusCode::kInvalidArgument);
  c.alignment = 256;
  c.capacity = 10;
  EXPECT_EQ(NewCudaTier(c).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(CudaHostRegister(nullptr, 10).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tiermem
