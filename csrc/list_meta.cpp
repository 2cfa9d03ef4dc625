// The bulk check of a multi-tensor elementwise op's lists (the fused master step): whether every
// entry is a plain tensor the native kernel takes as it is. One pass of the tensor reader over
// the lists, where the Python rules (accumkernels/ops/master_step_checks.py, layouts.py) read five
// or six attributes per tensor. It only ever accepts: any other answer sends the call down the
// Python path, which applies every rule and names a broken one.
#include <cstring>
#include <string>

#include "accumulate.h"
#include "torch_api.h"

namespace accumkernels {

// `lists`: a list of lists of tensors, lists[0] the masters; `kinds[k]` what lists[k] holds:
// kListFp32 (fp32, masters[i]'s sizes), kListLow (bf16/fp16, masters[i]'s sizes), kListStep
// (fp32, one element). True iff the reader is on and, for every list and entry i: the lists
// have one length, the entry is an exact torch.Tensor/nn.Parameter, strided, contiguous,
// without the neg bit, on masters[0]'s device, of its kind's dtype and sizes.
bool lists_plain(PyObject* lists, PyObject* kinds) {
  if (!torch_api_ready() || !PyList_Check(lists) || !PyList_Check(kinds)) return false;
  const Py_ssize_t n_lists = PyList_GET_SIZE(lists);
  if (n_lists == 0 || PyList_GET_SIZE(kinds) != n_lists) return false;
  PyObject* masters = PyList_GET_ITEM(lists, 0);
  if (!PyList_Check(masters)) return false;
  const Py_ssize_t n = PyList_GET_SIZE(masters);
  TensorMeta first{};
  if (n > 0 && !read_meta(PyList_GET_ITEM(masters, 0), first)) return false;
  for (Py_ssize_t k = 0; k < n_lists; ++k) {
    PyObject* list = PyList_GET_ITEM(lists, k);
    const long kind = PyLong_AsLong(PyList_GET_ITEM(kinds, k));
    if (kind == -1 && PyErr_Occurred()) {
      PyErr_Clear();
      return false;
    }
    if (!PyList_Check(list) || PyList_GET_SIZE(list) != n) return false;
    for (Py_ssize_t i = 0; i < n; ++i) {
      TensorMeta m{}, master{};
      if (!read_meta(PyList_GET_ITEM(list, i), m) || !m.contiguous || m.neg ||
          m.device_type != first.device_type || m.device_index != first.device_index)
        return false;
      if (kind == kListStep) {
        if (m.dtype != kFloat32 || m.numel != 1) return false;
        continue;
      }
      if (kind == kListLow ? (m.dtype != kBFloat16 && m.dtype != kFloat16) : m.dtype != kFloat32)
        return false;
      if (k > 0 && (!read_meta(PyList_GET_ITEM(masters, i), master) || !same_sizes(m, master)))
        return false;
    }
  }
  return true;
}

namespace {

// One tensor's record in a snapshot: the reader's facts as int64 words, sizes padded with 0.
constexpr size_t kRecordWords = 6 + kSnapshotDims;

bool record_of(PyObject* t, int64_t* out) {
  TensorMeta m{};
  if (!read_meta(t, m) || !m.contiguous || m.dtype < 0 || m.ndim > kSnapshotDims) return false;
  out[0] = static_cast<int64_t>(m.data);
  out[1] = m.numel;
  out[2] = m.ndim;
  out[3] = m.dtype;
  out[4] = (static_cast<int64_t>(m.device_type) << 32) | static_cast<uint32_t>(m.device_index);
  out[5] = m.neg ? 1 : 0;
  for (int64_t k = 0; k < kSnapshotDims; ++k) out[6 + k] = k < m.ndim ? m.sizes[k] : 0;
  return true;
}

}  // namespace

// Entries from `full` on: their address only (one word, the rest 0).
bool entry_of(PyObject* t, bool full, int64_t* out) {
  if (full) return record_of(t, out);
  uintptr_t data = 0;
  if (!read_data_ptr(t, data)) return false;
  std::memset(out, 0, kRecordWords * sizeof(int64_t));
  out[0] = static_cast<int64_t>(data);
  return true;
}

std::string metas_snapshot(PyObject* tensors, Py_ssize_t full) {
  if (!torch_api_ready() || !PyList_Check(tensors)) return {};
  const Py_ssize_t n = PyList_GET_SIZE(tensors);
  std::string snap(static_cast<size_t>(n) * kRecordWords * sizeof(int64_t) + sizeof(int64_t),
                   '\0');
  auto* words = reinterpret_cast<int64_t*>(snap.data());
  words[0] = full;  // (a record is compared with the same split only)
  for (Py_ssize_t i = 0; i < n; ++i)
    if (!entry_of(PyList_GET_ITEM(tensors, i), i < full, words + 1 + i * kRecordWords)) return {};
  return snap;
}

bool metas_same(PyObject* tensors, const std::string& snapshot) {
  if (snapshot.empty() || !torch_api_ready() || !PyList_Check(tensors)) return false;
  const Py_ssize_t n = PyList_GET_SIZE(tensors);
  if (snapshot.size() != static_cast<size_t>(n) * kRecordWords * sizeof(int64_t) +
                             sizeof(int64_t))
    return false;
  const auto* want = reinterpret_cast<const int64_t*>(snapshot.data());
  const int64_t full = want[0];
  int64_t now[kRecordWords];
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!entry_of(PyList_GET_ITEM(tensors, i), i < full, now) ||
        std::memcmp(now, want + 1 + i * kRecordWords, sizeof now) != 0)
      return false;
  }
  return true;
}

}  // namespace accumkernels
