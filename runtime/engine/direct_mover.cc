// Copy ids are a process-unique counter; a device<->NVMe bounce is one copy in the timeline
// (begin when the first leg starts, end when the second completes). The bounce buffer is
// owned by the chained callback and freed when the second leg completes.
#include "runtime/engine/direct_mover.h"

#include <atomic>
#include <cstring>
#include <vector>

namespace tiermem::engine {
namespace {

bool IsHostAddressable(const Endpoint& e) {
  return e.tier->kind() == TierKind::kHost && e.region.addr != nullptr;
}

class DirectMover final : public Mover {
 public:
  explicit DirectMover(TimelineRecorder* recorder) : recorder_(recorder) {}

  std::shared_ptr<Completion> Move(const MoveRequest& r) override {
    if (r.src.tier == nullptr || r.dst.tier == nullptr) {
      return Completion::Done(InvalidArgumentError("move: null tier"));
    }
    const uint64_t id = next_id_.fetch_add(1, std::memory_order_relaxed);  // unique only
    Record(EventType::kCopyBegin, id, r, kFlagNone);
    std::shared_ptr<Completion> done = Start(r);
    auto out = Completion::Make();
    done->OnDone([this, id, r, out](const Status& s) {
      Record(EventType::kCopyEnd, id, r, s.ok() ? kFlagNone : kFlagFailed);
      out->Complete(s);
    });
    return out;
  }

 private:
  std::shared_ptr<Completion> Start(const MoveRequest& r) {
    const bool src_host = IsHostAddressable(r.src);
    const bool dst_host = IsHostAddressable(r.dst);
    if (src_host && dst_host) {
      std::memcpy(static_cast<char*>(r.dst.region.addr) + r.dst.offset,
                  static_cast<const char*>(r.src.region.addr) + r.src.offset, r.bytes);
      return Completion::Done(OkStatus());
    }
    if (src_host) {
      return r.dst.tier->Copy(CopyRequest{r.dst.region, r.dst.offset,
                                          static_cast<char*>(r.src.region.addr) + r.src.offset,
                                          r.bytes, CopyDir::kToTier});
    }
    if (dst_host) {
      return r.src.tier->Copy(CopyRequest{r.src.region, r.src.offset,
                                          static_cast<char*>(r.dst.region.addr) + r.dst.offset,
                                          r.bytes, CopyDir::kFromTier});
    }
    // Neither side is host memory: bounce.
    auto buffer = std::make_shared<std::vector<char>>(r.bytes);
    auto out = Completion::Make();
    auto first = r.src.tier->Copy(
        CopyRequest{r.src.region, r.src.offset, buffer->data(), r.bytes, CopyDir::kFromTier});
    first->OnDone([r, buffer, out](const Status& s) {
      if (!s.ok()) {
        out->Complete(s);
        return;
      }
      auto second = r.dst.tier->Copy(
          CopyRequest{r.dst.region, r.dst.offset, buffer->data(), r.bytes, CopyDir::kToTier});
      second->OnDone([buffer, out](const Status& s2) { out->Complete(s2); });
    });
    return out;
  }

  void Record(EventType type, uint64_t id, const MoveRequest& r, uint8_t flags) {
    if (recorder_ == nullptr) return;
    Event e;
    e.type = type;
    e.id = id;
    e.bytes = r.bytes;
    e.chunk = r.chunk;
    e.tier = r.src.tier->kind();
    e.tier2 = r.dst.tier->kind();
    e.category = r.category;
    e.flags = flags;
    recorder_->Record(e);
  }

  TimelineRecorder* const recorder_;
  std::atomic<uint64_t> next_id_{1};
};

}  // namespace

std::unique_ptr<Mover> NewDirectMover(TimelineRecorder* recorder) {
  return std::make_unique<DirectMover>(recorder);
}

}  // namespace tiermem::engine
