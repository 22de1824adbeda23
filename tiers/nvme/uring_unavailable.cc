// Built instead of uring_backend.cc when TIERMEM_WITH_IO_URING is OFF.
#include "tiers/nvme/io_backend.h"

namespace tiermem::nvme {

StatusOr<std::unique_ptr<IoBackend>> NewUringBackend(const IoBackendConfig&) {
  return UnavailableError("io_uring: this build has no liburing (TIERMEM_WITH_IO_URING=OFF)");
}

}  // namespace tiermem::nvme
