// Include it before metal_stdlib (whose `thread` macro would hide std::thread).
// A CPU emulator for pagedkv's Metal kernels, compiled with metal/shim/metal_stdlib in
// run mode (PKV_SHIM_RUN). tests/metal_emulation.py generates, for each kernel, the
// source MLX's metal_kernel would compile plus a launcher that calls pkv_emu::dispatch.
//
// Model: Metal's dispatchThreads. Threadgroups run one after another; the threads of
// one run at once, one OS thread each, so simdgroup exchanges and threadgroup barriers
// block as on the GPU. An edge threadgroup holds only the threads inside the grid
// (non-uniform threadgroups); simdgroups are 32 consecutive threads of the linearized
// threadgroup. A lane that has returned reads as NaN in a shuffle or reduction of the
// lanes still running; a simdgroup or threadgroup that does not meet at a barrier
// within the timeout fails the launch (a divergent barrier hangs a GPU).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <functional>
#include <limits>
#include <mutex>
#include <thread>
#include <vector>

namespace pkv_emu {

struct Dim3 {
  unsigned x, y, z;
};

class Barrier {
 public:
  explicit Barrier(int n) : expected_(n) {}
  // False when the other participants did not arrive in time.
  bool wait(std::unique_lock<std::mutex>& lock, std::condition_variable& cv, bool& failed) {
    const long gen = gen_;
    if (++arrived_ == expected_) {
      arrived_ = 0;
      ++gen_;
      cv.notify_all();
      return true;
    }
    const bool ok = cv.wait_for(lock, std::chrono::seconds(20),
                                [&] { return gen_ != gen || failed; });
    if (!ok || (failed && gen_ == gen)) {
      failed = true;
      cv.notify_all();
      return false;
    }
    return true;
  }
  void drop(std::condition_variable& cv) {
    --expected_;
    if (arrived_ > 0 && arrived_ == expected_) {
      arrived_ = 0;
      ++gen_;
      cv.notify_all();
    }
  }

 private:
  int expected_;
  int arrived_ = 0;
  long gen_ = 0;
};

struct Group;

struct Simd {
  Barrier barrier;
  float slots[32];
  bool live[32];
  explicit Simd(int n) : barrier(n) {
    for (int i = 0; i < 32; ++i) live[i] = i < n;
  }
};

struct Group {
  std::mutex mutex;
  std::condition_variable cv;
  Barrier barrier;
  std::vector<Simd*> simds;
  bool failed = false;
  explicit Group(int n) : barrier(n) {}
};

struct Thread {
  Dim3 grid_pos, group_pos, pos_in_group;
  unsigned index_in_group, lane, simdgroup;
  unsigned simdgroups_per_group, threads_per_simdgroup;
  Group* group;
};

inline thread_local Thread* current = nullptr;
inline bool launch_failed = false;

inline Simd& my_simd() { return *current->group->simds[current->simdgroup]; }

inline float exchange(float v, unsigned mask, int op) {
  Group& g = *current->group;
  Simd& s = my_simd();
  std::unique_lock<std::mutex> lock(g.mutex);
  s.slots[current->lane] = v;
  if (!s.barrier.wait(lock, g.cv, g.failed)) return std::numeric_limits<float>::quiet_NaN();
  float r;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  if (op < 0) {
    const unsigned other = current->lane ^ mask;
    r = other < 32 && s.live[other] ? s.slots[other] : nan;
  } else {
    r = op == 0 ? 0.0f : s.slots[0];
    for (unsigned i = 0; i < 32; ++i) {
      if (!s.live[i]) {
        if (i < current->threads_per_simdgroup) r = nan;  // a lane that returned early
        continue;
      }
      const float x = s.slots[i];
      r = op == 0 ? r + x : op == 1 ? (x > r ? x : r) : (x < r ? x : r);
    }
  }
  s.barrier.wait(lock, g.cv, g.failed);  // every lane has read before slots change
  return r;
}

// Runs kernel(thread) for every thread of the grid. cooperative: the kernel uses SIMD
// functions or barriers (one OS thread per GPU thread of a threadgroup); otherwise the
// threads run one after another. Returns false if a barrier timed out.
inline bool dispatch(Dim3 grid, Dim3 tg, bool cooperative,
                     const std::function<void(const Thread&)>& kernel) {
  launch_failed = false;
  const Dim3 groups{(grid.x + tg.x - 1) / tg.x, (grid.y + tg.y - 1) / tg.y,
                    (grid.z + tg.z - 1) / tg.z};
  for (unsigned gz = 0; gz < groups.z; ++gz)
    for (unsigned gy = 0; gy < groups.y; ++gy)
      for (unsigned gx = 0; gx < groups.x; ++gx) {
        // Non-uniform edge threadgroups: only the threads inside the grid exist.
        const Dim3 size{std::min(tg.x, grid.x - gx * tg.x), std::min(tg.y, grid.y - gy * tg.y),
                        std::min(tg.z, grid.z - gz * tg.z)};
        const unsigned n = size.x * size.y * size.z;
        Group group{static_cast<int>(n)};
        const unsigned n_simd = (n + 31) / 32;
        std::vector<Simd> simds;
        simds.reserve(n_simd);
        for (unsigned s = 0; s < n_simd; ++s) simds.emplace_back(int(std::min(32u, n - 32 * s)));
        for (auto& s : simds) group.simds.push_back(&s);
        std::vector<Thread> threads(n);
        for (unsigned i = 0; i < n; ++i) {
          const unsigned x = i % size.x, y = (i / size.x) % size.y, z = i / (size.x * size.y);
          threads[i] = Thread{{gx * tg.x + x, gy * tg.y + y, gz * tg.z + z}, {gx, gy, gz},
                              {x, y, z}, i, i % 32, i / 32, n_simd,
                              std::min(32u, n - 32 * (i / 32)), &group};
        }
        auto run = [&](Thread& t) {
          current = &t;
          kernel(t);
          std::unique_lock<std::mutex> lock(group.mutex);
          Simd& s = *group.simds[t.simdgroup];
          s.live[t.lane] = false;
          s.barrier.drop(group.cv);
          group.barrier.drop(group.cv);
          current = nullptr;
        };
        if (cooperative) {
          std::vector<std::thread> os;
          os.reserve(n);
          for (auto& t : threads) os.emplace_back(run, std::ref(t));
          for (auto& t : os) t.join();
        } else {
          for (auto& t : threads) run(t);
        }
        if (group.failed) {
          launch_failed = true;
          return false;
        }
      }
  return true;
}

}  // namespace pkv_emu

float pkv_emu_shuffle_xor(float v, unsigned mask) { return pkv_emu::exchange(v, mask, -1); }
float pkv_emu_simd_reduce(float v, int op) { return pkv_emu::exchange(v, 0, op); }
void pkv_emu_threadgroup_barrier() {
  pkv_emu::Group& g = *pkv_emu::current->group;
  std::unique_lock<std::mutex> lock(g.mutex);
  g.barrier.wait(lock, g.cv, g.failed);
}
