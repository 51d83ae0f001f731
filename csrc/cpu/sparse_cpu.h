// CPU kernels of SparseLoCo's outer exchange (kernels/sparse.h has the contract). Raw pointers only.
#pragma once

#include "kernels/sparse.h"

namespace decentpy {

// e updated, the chunk-wise top-k of e in 2 bits written to the wire, what was sent taken out of e.
void sparse_pack_cpu(const SparsePackArgs& args);
// out = the mean of the members' decoded messages.
void sparse_mean_cpu(const SparseMeanArgs& args);

}  // namespace decentpy
