// The wire format of AsyncPipe's messages between neighbouring stages (decentpy/pipeline/transport.py
// sends and receives them; this file owns their layout).
//
// A message is a header of int64 slots and the raw bytes of its tensors:
//
//   header: [kind, mb, count, n, header_len, flags, per tensor: 0 (absent) | 1, dtype, rg, ndim, shape...]
//
// kind, mb (micro-batch) and count (the step's micro-batches) are the transport's (its control
// messages put a size in mb); n is the number of tensor slots; header_len the header's length in
// slots; flags bit 0: the tensors form a tuple; dtype a position in kDtypes; rg whether the
// tensor requires grad. A header is at least kHeaderSlots long (the fixed-size header the NCCL
// wire sends first; a longer one continues in a second message).
//
// One buffer (the gloo wire): [header | tensor 0 | tensor 1 | ...] in one uint8 CPU buffer, the
// header padded to kHeaderSlots slots, every part aligned to kAlign bytes; the received tensors
// are views of the buffer. Packing and unpacking are one call each: the message's path sits on
// the pipeline's critical path, where each Python-level tensor operation costs microseconds.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

namespace decentpy::pipe {

constexpr int64_t kHeaderSlots = 32;  // the fixed header (NCCL wire: its first message)
constexpr int64_t kFixed = 6;         // kind, mb, count, n, header_len, flags
constexpr int64_t kTupleFlag = 1;     // flags: the tensors are a tuple (a 1-tuple stays a tuple)
constexpr int64_t kAlign = 16;        // every part of a one-buffer message (the widest element: complex128)

// The dtypes a message carries; a dtype's code is its position (part of the wire format).
const std::vector<at::ScalarType>& dtypes();

// One tensor slot of a decoded header: nullopt when the sender had no tensor there.
struct TensorSpec {
  at::ScalarType dtype;
  bool requires_grad;
  std::vector<int64_t> shape;
};

struct Header {
  int64_t kind = 0;
  int64_t mb = 0;
  int64_t count = 0;
  bool is_tuple = false;
  std::vector<std::optional<TensorSpec>> specs;
};

using OptTensors = std::vector<std::optional<at::Tensor>>;

// The header of a message (at least kHeaderSlots long, zero-padded) as an int64 CPU tensor.
// Throws c10::TypeError (Python TypeError) for a dtype not in dtypes(), before anything is written.
at::Tensor encode_header(int64_t kind, int64_t mb, int64_t count, const OptTensors& tensors,
                         const std::vector<bool>& requires_grad, bool is_tuple);

// Decodes `values` (a header, at least its header_len slots). Throws on a malformed header.
Header decode_header(const std::vector<int64_t>& values);

// A header's length in slots, read from its first kHeaderSlots (the NCCL wire's first message).
int64_t header_length(const std::vector<int64_t>& first);

// Bytes of the one-buffer message carrying `tensors` (header included).
int64_t message_bytes(const OptTensors& tensors);

// Writes the one-buffer message into `buf` (a contiguous uint8 CPU tensor of at least
// message_bytes(tensors) bytes): header, then each tensor's values (materialised when it is a
// lazy conjugate or negation, in row-major order when it is not contiguous, copied from its
// device when it is not on the CPU). Every check runs before anything is written.
void pack(const at::Tensor& buf, int64_t kind, int64_t mb, int64_t count, const OptTensors& tensors,
          const std::vector<bool>& requires_grad, bool is_tuple);

// The message in `buf`: (kind, mb, count, is_tuple, tensors -- views of `buf`, an empty tensor
// for an empty one --, requires_grad per slot). Throws on a malformed message.
std::tuple<int64_t, int64_t, int64_t, bool, OptTensors, std::vector<bool>> unpack(const at::Tensor& buf);

}  // namespace decentpy::pipe
