// The CUDA kernel's own code (accumulate_kernel.h) run on the CPU, for tests: the same table
// building and launch choices as accumulate_cuda(), then each "launch" played block by block,
// thread by thread up to the block-wide barrier, then the post-barrier part. Built by the host
// compiler into every build of _C: no GPU, no CUDA runtime.
//
// Threads of a block only meet at the final barrier (each writes its own elements; the scale and
// the table are read-only), so running them one after another is one valid schedule. With
// norm_sq they also meet in a warp's shuffle tree before its atomicAdd: here each thread adds
// its own partial sum to the slot instead (same slots, same terms, another summation order).
#include <atomic>
#include <mutex>
#include <string>
#include <vector>

#include "accumulate.h"
#include "accumulate_kernel.h"

namespace accumkernels {
namespace {

std::atomic<int> g_sm_count{132};  // H100 SXM; tests vary it to move the grid-stride boundary
std::mutex g_log_mutex;
std::vector<std::string> g_log;  // the last call's launches, e.g. "param256 grid=8 chunks=20"

template <int kCap>
std::string table_name(const ParamTable<kCap>&) {
  return "param" + std::to_string(kCap);
}

// launch_entries' Launcher: plays each launch on the calling thread.
struct HostLauncher {
  std::vector<std::string> log;

  int64_t max_grid() const { return int64_t{g_sm_count.load()} * kBlocksPerSM; }
  template <class Table, bool kOverwrite, bool kNorm>
  void run(const Table& table, const LaunchArgs& args, unsigned grid) {
    log.push_back(std::string(args.zero_norm ? "zero_norm " : "") + table_name(table) +
                  " grid=" + std::to_string(grid) + " chunks=" + std::to_string(args.num_chunks) +
                  " tensors=" + std::to_string(table.num_tensors));
    for (unsigned block = 0; block < grid; ++block) {
      bool block_bad = false;  // __syncthreads_or over the block
      for (unsigned thread = 0; thread < kBlockThreads; ++thread)
        block_bad |= kernel_thread<Table, kOverwrite, kNorm>(table, args, block, thread, grid);
      if (args.found_inf != nullptr)
        for (unsigned thread = 0; thread < kBlockThreads; ++thread)
          after_barrier(args, block_bad, thread);
    }
  }
};

}  // namespace

void accumulate_cuda_host(const AccumulateArgs& a) {
  std::vector<TensorEntry> entries = make_entries(a);
  HostLauncher launcher;
  if (!entries.empty()) launch_entries(entries, a, launcher);
  const std::lock_guard<std::mutex> lock(g_log_mutex);
  g_log.swap(launcher.log);
}

void cuda_host_configure(int sm_count, bool /*capturing*/) {
  if (sm_count < 1) throw std::invalid_argument("cuda_host: sm_count must be >= 1");
  g_sm_count.store(sm_count);
}

std::vector<std::string> cuda_host_launches() {
  const std::lock_guard<std::mutex> lock(g_log_mutex);
  return g_log;
}

}  // namespace accumkernels
