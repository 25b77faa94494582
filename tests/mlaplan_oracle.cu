// FlashInfer's own MLAPlan (scheduler.cuh), run on the host without a GPU: the oracle that
// tests/test_fa3_plan.py holds tests/fa3_reference.py's schedule to. MLAPlan asks the CUDA runtime
// only for the current device and its SM count; both calls are renamed to stand-ins that answer
// with the SM count read from the input, so no GPU (and no driver) is needed.
//
// stdin (whitespace-separated ints):
//   num_sm batch_size num_heads head_dim_o causal
//   qo_indptr[batch_size + 1] kv_indptr[batch_size + 1] (page offsets) kv_len[batch_size]
// stdout, one array a line:
//   plan_info (MLAPlanInfo::ToVector, 18 values), work_indptr[num_clusters + 1],
//   q_indptr, kv_indptr, partial_indptr, q_len, kv_len, q_start, kv_start, kv_end [works each],
//   merge_start, merge_end, merge_partial_start, merge_partial_end, merge_stride [num_sm each]
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <vector>

cudaError_t oracle_get_device(int* device);
cudaError_t oracle_device_get_attribute(int* value, cudaDeviceAttr attr, int device);
#define cudaGetDevice oracle_get_device
#define cudaDeviceGetAttribute oracle_device_get_attribute
#include <flashinfer/attention/scheduler.cuh>

static int oracle_num_sm = 0;

cudaError_t oracle_get_device(int* device) {
  *device = 0;
  return cudaSuccess;
}

cudaError_t oracle_device_get_attribute(int* value, cudaDeviceAttr attr, int) {
  if (attr != cudaDevAttrMultiProcessorCount) return cudaErrorInvalidValue;
  *value = oracle_num_sm;
  return cudaSuccess;
}

static std::vector<int32_t> read_ints(size_t n) {
  std::vector<int32_t> v(n);
  for (auto& x : v) {
    if (!(std::cin >> x)) {
      std::cerr << "mlaplan_oracle: input ended early\n";
      std::exit(2);
    }
  }
  return v;
}

static void print_line(const int32_t* values, size_t n) {
  for (size_t i = 0; i < n; ++i) std::printf(i ? " %d" : "%d", values[i]);
  std::printf("\n");
}

int main() {
  int batch_size, num_heads, head_dim_o, causal;
  if (!(std::cin >> oracle_num_sm >> batch_size >> num_heads >> head_dim_o >> causal)) {
    std::cerr << "mlaplan_oracle: expected num_sm batch_size num_heads head_dim_o causal\n";
    return 2;
  }
  auto qo_indptr = read_ints(batch_size + 1);
  auto kv_indptr = read_ints(batch_size + 1);
  auto kv_len = read_ints(batch_size);

  // Workspaces as FlashInfer's wrapper sizes them; the float one only has offsets taken from it.
  const size_t int_bytes = 8 << 20, float_bytes = size_t(256) << 20;
  void* int_buffer = std::aligned_alloc(256, int_bytes);
  void* page_locked = std::aligned_alloc(256, int_bytes);
  void* float_buffer = std::aligned_alloc(256, float_bytes);
  flashinfer::MLAPlanInfo info;
  size_t staged = 0;
  cudaError_t err = flashinfer::MLAPlan<int32_t>(
      float_buffer, float_bytes, int_buffer, page_locked, int_bytes, info, staged, qo_indptr.data(),
      kv_indptr.data(), kv_len.data(), batch_size, num_heads, head_dim_o, causal != 0, nullptr);
  if (err != cudaSuccess) {
    std::cerr << "mlaplan_oracle: MLAPlan returned " << int(err) << "\n";
    return 1;
  }

  auto at = [&](int64_t offset) {
    return reinterpret_cast<const int32_t*>(static_cast<const char*>(page_locked) + offset);
  };
  const std::vector<int64_t> plan = info.ToVector();
  for (size_t i = 0; i < plan.size(); ++i) std::printf(i ? " %lld" : "%lld", (long long)plan[i]);
  std::printf("\n");
  const int num_clusters = int(info.num_blks_y);
  print_line(at(info.work_indptr_offset), num_clusters + 1);
  const int works = at(info.work_indptr_offset)[num_clusters];
  for (int64_t offset : {info.q_indptr_offset, info.kv_indptr_offset, info.partial_indptr_offset,
                         info.q_len_offset, info.kv_len_offset, info.q_start_offset,
                         info.kv_start_offset, info.kv_end_offset}) {
    print_line(at(offset), works);
  }
  for (int64_t offset : {info.merge_packed_offset_start_offset, info.merge_packed_offset_end_offset,
                         info.merge_partial_packed_offset_start_offset,
                         info.merge_partial_packed_offset_end_offset,
                         info.merge_partial_stride_offset}) {
    print_line(at(offset), oracle_num_sm);
  }
  return 0;
}
