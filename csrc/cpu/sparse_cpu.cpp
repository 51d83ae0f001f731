// CPU kernels of SparseLoCo's outer exchange (contract and arithmetic: kernels/sparse.h, shared with
// csrc/cuda/sparse.cu). Chunks in parallel (at::parallel_for); inside a chunk scalar code: the error
// update with a histogram of the magnitudes' top bits, the k-th largest magnitude (a partial
// selection within its bin), one scan in offset order for the selected elements, the codes. The mean runs chunk by chunk, the
// members in their order inside each chunk (the rounding order of the contract).
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "cpu/sparse_cpu.h"
#include "kernels/sparse.h"

namespace decentpy {
namespace {

// The radix step's bins: a magnitude's top 11 bits (its exponent and 3 mantissa bits; bit 31 is 0).
constexpr int kShift = 20;
constexpr int64_t kBins = int64_t{1} << (31 - kShift);

}  // namespace

void sparse_pack_cpu(const SparsePackArgs& A) {
  const int64_t n = A.numel, chunk = A.chunk, k = A.k;
  const int64_t chunks = sparse_chunks(n, chunk);
  uint8_t* offsets = sparse_offsets(A.wire, n, chunk);
  uint8_t* codes = sparse_codes(A.wire, n, chunk, k);
  float* scales = sparse_scales(A.wire);
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    std::vector<uint32_t> mags(static_cast<size_t>(chunk));
    std::vector<uint32_t> hist(kBins);
    std::vector<uint32_t> sel(static_cast<size_t>(k));
    std::vector<float> vals(static_cast<size_t>(k));
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t base = c * chunk, size = sparse_chunk_size(n, chunk, c), kc = sparse_chunk_k(n, chunk, k, c);
      float* E = A.error + base;
      // The k-th largest magnitude t, by a radix step: a histogram of the keys' top bits (in the pass
      // of the error update), the bin that holds the k-th largest, then a partial selection among
      // that bin's keys only. The selection under the total order (|e| descending, then the lower
      // offset) is every element above t and the lowest offsets at t, which one scan in offset order
      // finds (already sorted).
      std::fill(hist.begin(), hist.end(), 0u);
      for (int64_t j = 0; j < size; ++j) {
        E[j] = sparse_error(E[j], A.theta[base + j], A.param[base + j], A.decay);
        const uint32_t m = sparse_abs_bits(E[j]);
        mags[j] = m;
        ++hist[m >> kShift];
      }
      int64_t bin = kBins - 1, above = 0;  // above: elements in the bins above `bin`
      while (above + hist[bin] < kc) above += hist[bin--];
      int64_t nb = 0;
      for (int64_t j = 0; j < size; ++j)
        if ((mags[j] >> kShift) == static_cast<uint32_t>(bin)) mags[nb++] = mags[j];  // (in place: nb <= j)
      const int64_t need = kc - above;  // the need-th largest of the bin is t
      std::nth_element(mags.begin(), mags.begin() + (need - 1), mags.begin() + nb, std::greater<uint32_t>());
      const uint32_t t = mags[need - 1];
      int64_t above_t = above;
      for (int64_t j = 0; j < need; ++j) above_t += mags[j] > t;  // (the first `need` hold the bin's largest)
      int64_t at_t = kc - above_t, got = 0;
      for (int64_t j = 0; j < size && got < kc; ++j) {
        const uint32_t m = sparse_abs_bits(E[j]);
        if (m > t || (m == t && at_t-- > 0)) sel[got++] = static_cast<uint32_t>(j);
      }
      const int64_t first = sparse_first_slot(c, k);
      for (int64_t q = 0; q < kc; ++q) vals[q] = E[sel[q]];
      for (int64_t q = 0; q < kc; q += 2)  // (first is a multiple of 4: the pairs are this chunk's)
        sparse_put_offsets(offsets, (first + q) / 2, sel[q], q + 1 < kc ? sel[q + 1] : 0u, q + 1 < kc);
      float s_lo, s_hi;
      const float a = sparse_scales_of([&](int64_t q) { return vals[q]; }, kc, &s_lo, &s_hi);
      scales[2 * c] = s_lo;
      scales[2 * c + 1] = s_hi;
      uint8_t* Q = codes + first / 4;
      for (int64_t b = 0; 4 * b < kc; ++b) {
        uint32_t byte = 0;
        for (int64_t j = 0; j < 4 && 4 * b + j < kc; ++j) {
          const int64_t q = 4 * b + j;
          const uint32_t code = sparse_code(vals[q], a);
          byte |= code << (2 * j);
          E[sel[q]] = vals[q] - sparse_value(code, s_lo, s_hi);
        }
        Q[b] = static_cast<uint8_t>(byte);
      }
    }
  });
}

void sparse_mean_cpu(const SparseMeanArgs& A) {
  const int64_t n = A.numel, chunk = A.chunk, k = A.k;
  const int m = A.num_inputs;
  const float inv_m = ScalarMath::div(1.f, static_cast<float>(m));
  at::parallel_for(0, sparse_chunks(n, chunk), 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t base = c * chunk, size = sparse_chunk_size(n, chunk, c), kc = sparse_chunk_k(n, chunk, k, c);
      const int64_t first = sparse_first_slot(c, k);
      float* O = A.out + base;
      std::fill(O, O + size, 0.f);
      for (int t = 0; t < m; ++t) {
        const void* w = A.inputs[t];
        const uint8_t* I = sparse_offsets(w, n, chunk);
        const uint8_t* Q = sparse_codes(w, n, chunk, k);
        const float s_lo = sparse_scales(w)[2 * c], s_hi = sparse_scales(w)[2 * c + 1];
        for (int64_t j = 0; j < kc; ++j)
          O[sparse_offset_at(I, first + j)] += sparse_value(sparse_code_at(Q, first + j), s_lo, s_hi);
      }
      for (int64_t j = 0; j < size; ++j) O[j] = ScalarMath::mul(O[j], inv_m);
    }
  });
}

}  // namespace decentpy
