// AsyncPipe's wire format (see message.h).
#include "pipeline/message.h"

#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>
#include <c10/util/safe_numerics.h>

#include <algorithm>
#include <cstring>
#include <sstream>
#include <string>

namespace decentpy::pipe {

namespace {

std::string dtype_name(at::ScalarType t) {
  return "torch." + std::string(c10::getDtypeNames(t).first);
}

int64_t code_of(at::ScalarType t) {
  const auto& all = dtypes();
  auto it = std::find(all.begin(), all.end(), t);
  if (it == all.end()) {
    std::ostringstream names;
    for (size_t i = 0; i < all.size(); ++i) names << (i ? ", " : "") << dtype_name(all[i]);
    TORCH_CHECK_TYPE(false, "a tensor of dtype ", dtype_name(t),
                     " cannot cross a pipeline stage boundary; supported: ", names.str());
  }
  return static_cast<int64_t>(it - all.begin());
}

constexpr int64_t kMaxTensorBytes = int64_t{1} << 56;  // far beyond any tensor; keeps the offsets' sums in range

int64_t aligned(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// Byte offset of the first tensor of a one-buffer message whose header has `header_len` slots.
int64_t first_offset(int64_t header_len) { return aligned(8 * std::max(header_len, kHeaderSlots)); }

// Checked: a malformed header must not wrap a size around into a view that looks valid.
int64_t nbytes_of(at::ScalarType dtype, const std::vector<int64_t>& shape) {
  int64_t n = static_cast<int64_t>(c10::elementSize(dtype));
  for (int64_t d : shape)
    TORCH_CHECK(!c10::mul_overflows(n, d, &n), "malformed pipeline message: a tensor of shape ", shape,
                " overflows int64 bytes");
  return n;
}

std::vector<int64_t> header_values(int64_t kind, int64_t mb, int64_t count, const OptTensors& tensors,
                                   const std::vector<bool>& requires_grad, bool is_tuple) {
  TORCH_CHECK_VALUE(requires_grad.size() == tensors.size(), "a pipeline message needs one requires_grad flag per ",
                    "tensor: got ", requires_grad.size(), " flags for ", tensors.size(), " tensors");
  std::vector<int64_t> v = {kind, mb, count, static_cast<int64_t>(tensors.size()), 0, is_tuple ? kTupleFlag : 0};
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!tensors[i].has_value()) {
      v.push_back(0);
      continue;
    }
    const at::Tensor& t = *tensors[i];
    v.insert(v.end(), {1, code_of(t.scalar_type()), requires_grad[i] ? 1 : 0, t.dim()});
    v.insert(v.end(), t.sizes().begin(), t.sizes().end());
  }
  v[4] = static_cast<int64_t>(v.size());
  return v;
}

// The tensors' byte offsets in a one-buffer message with header `header_len`, and its size
// (at most `limit`: a received message's buffer, checked part by part so that no sum overflows).
int64_t layout(int64_t header_len, const std::vector<std::optional<TensorSpec>>& specs, std::vector<int64_t>* offsets,
               int64_t limit = kMaxTensorBytes) {
  int64_t at = first_offset(header_len);
  for (const auto& spec : specs) {
    if (offsets) offsets->push_back(at);
    if (!spec) continue;
    const int64_t nbytes = nbytes_of(spec->dtype, spec->shape);
    TORCH_CHECK(nbytes <= kMaxTensorBytes, "malformed pipeline message: a tensor of ", nbytes, " bytes");
    at += aligned(nbytes);
    TORCH_CHECK(at <= limit, "malformed pipeline message: its tensors end at byte ", at, " of a buffer of ", limit);
  }
  return at;
}

std::vector<std::optional<TensorSpec>> specs_of(const OptTensors& tensors) {
  std::vector<std::optional<TensorSpec>> specs;
  specs.reserve(tensors.size());
  for (const auto& t : tensors) {
    if (t)
      specs.push_back(TensorSpec{t->scalar_type(), false, t->sizes().vec()});
    else
      specs.emplace_back(std::nullopt);
  }
  return specs;
}

void check_buffer(const at::Tensor& buf, const char* what) {
  TORCH_CHECK(buf.device().is_cpu() && buf.scalar_type() == at::kByte && buf.dim() == 1 && buf.is_contiguous(),
              what, ": a pipeline message buffer must be a contiguous 1-D uint8 CPU tensor, got ", buf.scalar_type(),
              " of shape ", buf.sizes(), " on ", buf.device());
}

}  // namespace

const std::vector<at::ScalarType>& dtypes() {
  static const std::vector<at::ScalarType> all = {
      at::kFloat, at::kDouble, at::kHalf,   at::kBFloat16, at::kLong,          at::kInt,
      at::kShort, at::kChar,   at::kByte,   at::kBool,     at::kComplexFloat, at::kComplexDouble};
  return all;
}

at::Tensor encode_header(int64_t kind, int64_t mb, int64_t count, const OptTensors& tensors,
                         const std::vector<bool>& requires_grad, bool is_tuple) {
  std::vector<int64_t> v = header_values(kind, mb, count, tensors, requires_grad, is_tuple);
  at::Tensor out = at::zeros({std::max<int64_t>(static_cast<int64_t>(v.size()), kHeaderSlots)}, at::kLong);
  std::memcpy(out.data_ptr<int64_t>(), v.data(), v.size() * sizeof(int64_t));
  return out;
}

Header decode_header(const std::vector<int64_t>& values) {
  const int64_t avail = static_cast<int64_t>(values.size());
  TORCH_CHECK(avail >= kFixed, "malformed pipeline message: a header of ", avail, " slots (at least ", kFixed, ")");
  const int64_t n = values[3], len = values[4];
  TORCH_CHECK(n >= 0 && len >= kFixed + n && len <= avail, "malformed pipeline message: ", n, " tensors in a header of ",
              len, " slots (", avail, " available)");
  Header h;
  h.kind = values[0];
  h.mb = values[1];
  h.count = values[2];
  h.is_tuple = (values[5] & kTupleFlag) != 0;
  h.specs.reserve(n);
  const auto& all = dtypes();
  int64_t i = kFixed;
  for (int64_t k = 0; k < n; ++k) {
    TORCH_CHECK(i < len, "malformed pipeline message: the header ends inside tensor ", k);
    if (values[i] == 0) {
      h.specs.emplace_back(std::nullopt);
      ++i;
      continue;
    }
    TORCH_CHECK(i + 4 <= len, "malformed pipeline message: the header ends inside tensor ", k);
    const int64_t code = values[i + 1], ndim = values[i + 3];
    TORCH_CHECK(values[i] == 1 && code >= 0 && code < static_cast<int64_t>(all.size()) && ndim >= 0 &&
                    i + 4 + ndim <= len,
                "malformed pipeline message: tensor ", k, " has presence ", values[i], ", dtype code ", code,
                " and ", ndim, " dimensions");
    TensorSpec spec{all[code], values[i + 2] != 0, std::vector<int64_t>(values.begin() + i + 4,
                                                                         values.begin() + i + 4 + ndim)};
    for (int64_t d : spec.shape) TORCH_CHECK(d >= 0, "malformed pipeline message: tensor ", k, " has size ", d);
    h.specs.emplace_back(std::move(spec));
    i += 4 + ndim;
  }
  return h;
}

int64_t message_bytes(const OptTensors& tensors) {
  // the header's length as header_values makes it (which also refuses a dtype, before any message is sent)
  const auto len = header_values(0, 0, 0, tensors, std::vector<bool>(tensors.size()), false).size();
  return layout(static_cast<int64_t>(len), specs_of(tensors), nullptr);
}

int64_t header_length(const std::vector<int64_t>& first) {
  TORCH_CHECK(static_cast<int64_t>(first.size()) >= kFixed && first[4] >= kFixed,
              "malformed pipeline message: a header of ", first.size(), " slots");
  return first[4];
}

void pack(const at::Tensor& buf, int64_t kind, int64_t mb, int64_t count, const OptTensors& tensors,
          const std::vector<bool>& requires_grad, bool is_tuple) {
  check_buffer(buf, "pack");
  std::vector<int64_t> v = header_values(kind, mb, count, tensors, requires_grad, is_tuple);
  std::vector<int64_t> offsets;
  const int64_t total = layout(static_cast<int64_t>(v.size()), specs_of(tensors), &offsets);
  TORCH_CHECK(buf.numel() >= total, "pack: a message of ", total, " bytes does not fit a buffer of ", buf.numel());
  auto* base = static_cast<uint8_t*>(buf.data_ptr());
  std::memcpy(base, v.data(), v.size() * sizeof(int64_t));
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!tensors[i] || tensors[i]->numel() == 0) continue;
    const at::Tensor& t = *tensors[i];
    const int64_t nbytes = t.numel() * static_cast<int64_t>(t.element_size());
    if (t.device().is_cpu() && t.is_contiguous() && !t.is_conj() && !t.is_neg()) {
      std::memcpy(base + offsets[i], t.const_data_ptr(), static_cast<size_t>(nbytes));
    } else {  // straight into the buffer: one copy, also when t is not contiguous (copy_ resolves conj/neg)
      buf.narrow(0, offsets[i], nbytes).view(t.scalar_type()).view(t.sizes()).copy_(t.detach());
    }
  }
}

std::tuple<int64_t, int64_t, int64_t, bool, OptTensors, std::vector<bool>> unpack(const at::Tensor& buf) {
  check_buffer(buf, "unpack");
  TORCH_CHECK(buf.numel() >= 8 * kFixed, "malformed pipeline message: a buffer of ", buf.numel(), " bytes");
  const auto* words = static_cast<const int64_t*>(buf.const_data_ptr());
  const int64_t len = words[4];
  TORCH_CHECK(len >= kFixed && len <= buf.numel() / 8, "malformed pipeline message: a header of ", len,
              " slots in a buffer of ", buf.numel(), " bytes");
  Header h = decode_header(std::vector<int64_t>(words, words + len));
  std::vector<int64_t> offsets;
  layout(len, h.specs, &offsets, buf.numel());
  OptTensors tensors;
  std::vector<bool> requires_grad;
  tensors.reserve(h.specs.size());
  requires_grad.reserve(h.specs.size());
  for (size_t i = 0; i < h.specs.size(); ++i) {
    const auto& spec = h.specs[i];
    if (!spec) {
      tensors.emplace_back(std::nullopt);
      requires_grad.push_back(false);
      continue;
    }
    const int64_t nbytes = nbytes_of(spec->dtype, spec->shape);
    tensors.emplace_back(nbytes > 0 ? buf.narrow(0, offsets[i], nbytes).view(spec->dtype).view(spec->shape)
                                    : at::empty(spec->shape, buf.options().dtype(spec->dtype)));
    requires_grad.push_back(spec->requires_grad);
  }
  return {h.kind, h.mb, h.count, h.is_tuple, std::move(tensors), std::move(requires_grad)};
}

}  // namespace decentpy::pipe
