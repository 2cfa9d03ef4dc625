// The intake's per-param autograd hooks (accumkernels/optim/intake/intake.py) as C callables.
//
// Autograd calls a tensor pre-hook and a post-accumulate-grad hook for every param in every
// backward. As Python functions each costs a frame and a handful of bytecodes on top of what it
// does; for a model of 148 params that is most of what the wrapper adds to a backward. These
// types do the common case of each hook with the same C API calls the Python code makes
// (attribute reads and writes, dict and set updates) and call the intake's Python method for
// everything else, so the Python method stays the one definition of what a hook does:
//
// What a hook shares with the intake is one small object, `state` (a HookState of
// accumkernels/optim/intake/moves.py): `state.fast` says whether the fast case applies (see
// fast_open); its containers (`views`, `showable`, `hidden`, `pending`, `flushed`) are read once
// at construction: the intake updates them in place and never replaces them.
//
// * PreHook(intake_ref, state, i, param_ref): in a backward the fast case applies to,
//   p.grad None: nothing; p.grad its view (views[i]): p.grad = None and i added to `hidden`.
//   Otherwise `intake.before_grad(i, grad)`.
// * PostHook(intake_ref, state, i, master, bucket, bucket_len): in such a backward, p.grad a
//   gradient (not None, not the view): p.grad = showable[i], i dropped from `hidden`, p's master
//   (if any) shows the view, the gradient held in `pending[bucket][i]` (added to one held
//   already: reentrant checkpointing), and `intake.launch_held(bucket, pend)` once the bucket is
//   complete (launch_held, or the end of the backward finding gradients held, counts the
//   backward as a micro-batch). Otherwise `intake.after_grad(i, p)`.
// The fast case is set per backward by Intake._begin: the views shown as the hooks go, no
// create_graph (grad mode off inside the backward), no DDP, no per-micro-batch check; inside
// it every gradient is dense only if the launch finds it so (Intake.launch_held names a sparse
// one). Both hold the intake and the param weakly (a hook on a param that held it would keep it
// alive through autograd's C++ side, where no Python collector sees the cycle).
#include <pybind11/pybind11.h>
#include <structmember.h>

#include <cstddef>

namespace accumkernels {
namespace {

PyObject* s_grad = nullptr;
PyObject* s_fast = nullptr;
PyObject* s_views = nullptr;
PyObject* s_showable = nullptr;
PyObject* s_hidden = nullptr;
PyObject* s_pending = nullptr;
PyObject* s_flushed = nullptr;
PyObject* s_before_grad = nullptr;
PyObject* s_after_grad = nullptr;
PyObject* s_launch_held = nullptr;
PyObject* s_add_ = nullptr;

// A new reference to the object behind weakref `ref`, or nullptr when it is gone.
PyObject* deref(PyObject* ref) {
  PyObject* obj = PyWeakref_GetObject(ref);  // borrowed
  if (obj == nullptr || obj == Py_None) return nullptr;
  Py_INCREF(obj);
  return obj;
}

// Whether the hooks' fast case applies now: `state.fast` is the weakref to the open
// backward's final callback (set by Intake._begin when the fast case applies to the whole
// backward, None otherwise) and that callback is still alive (a backward that raised drops
// it). 1 yes, 0 no, -1 error.
int fast_open(PyObject* state) {
  PyObject* ref = PyObject_GetAttr(state, s_fast);
  if (ref == nullptr) return -1;
  int open = 0;
  if (PyWeakref_Check(ref)) {
    PyObject* end = PyWeakref_GetObject(ref);
    open = end != nullptr && end != Py_None;
  }
  Py_DECREF(ref);
  return open;
}

// ---- shared by both hooks --------------------------------------------------------------------
// Whether a vectorcall got exactly one positional argument (else a TypeError naming `what`).
bool one_argument(size_t nargsf, PyObject* kwnames, const char* what) {
  if (PyVectorcall_NARGS(nargsf) == 1 && kwnames == nullptr) return true;
  PyErr_Format(PyExc_TypeError, "%s takes one argument", what);
  return false;
}

// The end of a hook's call: `done` from its fast case (1 done, 0 declined, -1 error); declined,
// the intake's Python `method(index, arg)` does it. Releases `intake`; None, or nullptr on error.
PyObject* finish(int done, PyObject* intake, PyObject* method, PyObject* index, PyObject* arg) {
  if (done == 0) {
    PyObject* r = PyObject_CallMethodObjArgs(intake, method, index, arg, nullptr);
    done = r == nullptr ? -1 : 1;
    Py_XDECREF(r);
  }
  Py_DECREF(intake);
  if (done < 0) return nullptr;
  Py_RETURN_NONE;
}

// state.<name> as a new reference of `type` (a container the intake never replaces), or
// nullptr with a TypeError.
PyObject* shared(PyObject* state, PyObject* name, PyTypeObject* type) {
  PyObject* obj = PyObject_GetAttr(state, name);
  if (obj != nullptr && !PyObject_TypeCheck(obj, type)) {
    PyErr_Format(PyExc_TypeError, "accumkernels grad hook: state.%U must be a %s", name,
                 type->tp_name);
    Py_CLEAR(obj);
  }
  return obj;
}

// The param index of a hook (a non-negative int), or -1 with an exception.
Py_ssize_t index_of(PyObject* index) {
  const Py_ssize_t i = PyLong_AsSsize_t(index);
  if (i < 0 && !PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "negative param index");
  return i;
}

// ---- PreHook -------------------------------------------------------------------------------
struct PreHook {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  PyObject* intake_ref;
  PyObject* state;  // the HookState shared with the intake
  PyObject* index;  // i as a Python int
  Py_ssize_t i;
  PyObject* param_ref;
  PyObject* views;   // the intake's views (a list it updates in place)
  PyObject* hidden;  // the intake's set of hidden views (never replaced, cleared in place)
};

// views[i] (borrowed), or nullptr with an IndexError.
PyObject* item(PyObject* list, Py_ssize_t i) {
  if (i >= PyList_GET_SIZE(list)) {
    PyErr_SetString(PyExc_IndexError, "accumkernels grad hook: param index out of range");
    return nullptr;
  }
  return PyList_GET_ITEM(list, i);
}

// The fast case; 1 done, 0 not taken (nothing changed), -1 error.
int pre_fast(PreHook* self) {
  const int open = fast_open(self->state);
  if (open <= 0) return open;
  PyObject* param = deref(self->param_ref);
  if (param == nullptr) return 0;
  PyObject* view = item(self->views, self->i);
  PyObject* g = view == nullptr ? nullptr : PyObject_GetAttr(param, s_grad);
  int done = 0;
  if (g == nullptr) {
    done = -1;
  } else if (g == Py_None) {
    done = 1;
  } else if (g == view) {
    done = PyObject_SetAttr(param, s_grad, Py_None) == 0 &&
                   PySet_Add(self->hidden, self->index) == 0
               ? 1
               : -1;
  }
  Py_XDECREF(g);
  Py_DECREF(param);
  return done;
}

PyObject* pre_vectorcall(PyObject* obj, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  auto* self = reinterpret_cast<PreHook*>(obj);
  if (!one_argument(nargsf, kwnames, "PreHook (the gradient)")) return nullptr;
  PyObject* intake = deref(self->intake_ref);
  if (intake == nullptr) Py_RETURN_NONE;
  return finish(pre_fast(self), intake, s_before_grad, self->index, args[0]);
}

int pre_init(PyObject* obj, PyObject* args, PyObject* kwargs) {
  auto* self = reinterpret_cast<PreHook*>(obj);
  PyObject *intake_ref, *state, *index, *param_ref;
  if (!PyArg_ParseTuple(args, "O!OO!O!", &_PyWeakref_RefType, &intake_ref, &state, &PyLong_Type,
                        &index, &_PyWeakref_RefType, &param_ref))
    return -1;
  self->i = index_of(index);
  if (self->i < 0) return -1;
  PyObject* views = shared(state, s_views, &PyList_Type);
  PyObject* hidden = views == nullptr ? nullptr : shared(state, s_hidden, &PySet_Type);
  if (hidden == nullptr) {
    Py_XDECREF(views);
    return -1;
  }
  self->vectorcall = pre_vectorcall;
  Py_XSETREF(self->intake_ref, Py_NewRef(intake_ref));
  Py_XSETREF(self->state, Py_NewRef(state));
  Py_XSETREF(self->index, Py_NewRef(index));
  Py_XSETREF(self->param_ref, Py_NewRef(param_ref));
  Py_XSETREF(self->views, views);
  Py_XSETREF(self->hidden, hidden);
  return 0;
}

void pre_dealloc(PyObject* obj) {
  auto* self = reinterpret_cast<PreHook*>(obj);
  PyTypeObject* type = Py_TYPE(obj);
  Py_CLEAR(self->intake_ref);
  Py_CLEAR(self->state);
  Py_CLEAR(self->index);
  Py_CLEAR(self->param_ref);
  Py_CLEAR(self->views);
  Py_CLEAR(self->hidden);
  type->tp_free(obj);
  Py_DECREF(type);
}

PyMemberDef pre_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(PreHook, vectorcall), READONLY, nullptr},
    {nullptr, 0, 0, 0, nullptr}};

PyType_Slot pre_slots[] = {
    {Py_tp_call, reinterpret_cast<void*>(PyVectorcall_Call)},
    {Py_tp_members, pre_members},
    {Py_tp_init, reinterpret_cast<void*>(pre_init)},
    {Py_tp_dealloc, reinterpret_cast<void*>(pre_dealloc)},
    {Py_tp_new, reinterpret_cast<void*>(PyType_GenericNew)},
    {Py_tp_doc, const_cast<char*>("The intake's tensor pre-hook for one param (grad_hooks.cpp).")},
    {0, nullptr}};
PyType_Spec pre_spec = {"accumkernels._C.PreHook", sizeof(PreHook), 0,
                        Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL, pre_slots};

// ---- PostHook ------------------------------------------------------------------------------
struct PostHook {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  PyObject* intake_ref;
  PyObject* state;  // the HookState shared with the intake
  PyObject* index;
  Py_ssize_t i;
  PyObject* shown;  // per param what p.grad shows once its gradient is held (a list, in place)
  PyObject* views;  // the intake's views (a list it updates in place)
  PyObject* hidden;
  PyObject* master;  // p's fp32 master weight, or None (a master object is never replaced)
  PyObject* pending;  // bucket -> {param index: held gradient} (the intake's, cleared in place)
  PyObject* flushed;  // bucket -> params moved early (the intake's, cleared in place)
  PyObject* bucket;   // p's bucket index as a Python int
  Py_ssize_t bucket_len;
};

// The fast case; 1 done, 0 not taken (nothing changed), -1 error.
int post_fast(PostHook* self, PyObject* intake, PyObject* param) {
  const int open = fast_open(self->state);
  if (open <= 0) return open;
  PyObject* view = item(self->views, self->i);  // borrowed
  if (view == nullptr) return -1;
  PyObject* g = PyObject_GetAttr(param, s_grad);
  if (g == nullptr) return -1;
  int done = 0;
  PyObject* shown = nullptr;  // borrowed
  PyObject* pend = nullptr;
  // None: p frozen since the forward (autograd stored nothing); the view: not hidden. Python's
  if (g == Py_None || g == view) goto out;  // cases, as every gradient in a bucket of the fast
  // path's first launch (a sparse one is refused there, in Intake.launch_held)
  // from here on the fast case is taken: nothing below may decline
  shown = item(self->shown, self->i);
  if (shown == nullptr || PyObject_SetAttr(param, s_grad, shown) != 0 ||
      PySet_Discard(self->hidden, self->index) < 0)
    goto fail;
  if (self->master != Py_None) {
    PyObject* mg = PyObject_GetAttr(self->master, s_grad);
    if (mg == nullptr) goto fail;
    const bool same = mg == view;
    Py_DECREF(mg);
    if (!same && PyObject_SetAttr(self->master, s_grad, view) != 0) goto fail;
  }
  pend = PyDict_GetItemWithError(self->pending, self->bucket);  // borrowed
  if (pend == nullptr) {
    if (PyErr_Occurred()) goto fail;
    pend = PyDict_New();
    if (pend == nullptr || PyDict_SetItem(self->pending, self->bucket, pend) != 0) goto fail;
  } else {
    Py_INCREF(pend);
  }
  {
    PyObject* held = PyDict_GetItemWithError(pend, self->index);  // borrowed
    if (held == nullptr && PyErr_Occurred()) goto fail;
    if (held != nullptr) {  // a second gradient for p in this backward (reentrant checkpointing)
      PyObject* sum = PyObject_CallMethodObjArgs(held, s_add_, g, nullptr);
      if (sum == nullptr) goto fail;
      Py_DECREF(sum);
      done = 1;
      goto out;
    }
  }
  if (PyDict_SetItem(pend, self->index, g) != 0) goto fail;
  {
    Py_ssize_t moved = 0;
    PyObject* early = PyDict_GetItemWithError(self->flushed, self->bucket);  // borrowed
    if (early == nullptr && PyErr_Occurred()) goto fail;
    if (early != nullptr) {
      moved = PyLong_AsSsize_t(early);
      if (moved == -1 && PyErr_Occurred()) goto fail;
    }
    if (PyDict_GET_SIZE(pend) + moved == self->bucket_len) {
      if (PyDict_DelItem(self->pending, self->bucket) != 0) goto fail;
      PyObject* res =
          PyObject_CallMethodObjArgs(intake, s_launch_held, self->bucket, pend, nullptr);
      if (res == nullptr) goto fail;
      Py_DECREF(res);
    }
  }
  done = 1;
  goto out;
fail:
  done = -1;
out:
  Py_XDECREF(pend);
  Py_DECREF(g);
  return done;
}

PyObject* post_vectorcall(PyObject* obj, PyObject* const* args, size_t nargsf,
                          PyObject* kwnames) {
  auto* self = reinterpret_cast<PostHook*>(obj);
  if (!one_argument(nargsf, kwnames, "PostHook (the param)")) return nullptr;
  PyObject* intake = deref(self->intake_ref);
  if (intake == nullptr) Py_RETURN_NONE;
  return finish(post_fast(self, intake, args[0]), intake, s_after_grad, self->index, args[0]);
}

int post_init(PyObject* obj, PyObject* args, PyObject* kwargs) {
  auto* self = reinterpret_cast<PostHook*>(obj);
  PyObject *intake_ref, *state, *index, *master, *bucket;
  Py_ssize_t bucket_len;
  if (!PyArg_ParseTuple(args, "O!OO!OO!n", &_PyWeakref_RefType, &intake_ref, &state,
                        &PyLong_Type, &index, &master, &PyLong_Type, &bucket, &bucket_len))
    return -1;
  self->i = index_of(index);
  if (self->i < 0) return -1;
  PyObject* shown = shared(state, s_showable, &PyList_Type);
  PyObject* views = shown == nullptr ? nullptr : shared(state, s_views, &PyList_Type);
  PyObject* hidden = views == nullptr ? nullptr : shared(state, s_hidden, &PySet_Type);
  PyObject* pending = hidden == nullptr ? nullptr : shared(state, s_pending, &PyDict_Type);
  PyObject* flushed = pending == nullptr ? nullptr : shared(state, s_flushed, &PyDict_Type);
  if (flushed == nullptr) {
    Py_XDECREF(shown);
    Py_XDECREF(views);
    Py_XDECREF(hidden);
    Py_XDECREF(pending);
    return -1;
  }
  self->vectorcall = post_vectorcall;
  Py_XSETREF(self->intake_ref, Py_NewRef(intake_ref));
  Py_XSETREF(self->state, Py_NewRef(state));
  Py_XSETREF(self->index, Py_NewRef(index));
  Py_XSETREF(self->shown, shown);
  Py_XSETREF(self->views, views);
  Py_XSETREF(self->hidden, hidden);
  Py_XSETREF(self->master, Py_NewRef(master));
  Py_XSETREF(self->pending, pending);
  Py_XSETREF(self->flushed, flushed);
  Py_XSETREF(self->bucket, Py_NewRef(bucket));
  self->bucket_len = bucket_len;
  return 0;
}

void post_dealloc(PyObject* obj) {
  auto* self = reinterpret_cast<PostHook*>(obj);
  PyTypeObject* type = Py_TYPE(obj);
  Py_CLEAR(self->intake_ref);
  Py_CLEAR(self->state);
  Py_CLEAR(self->index);
  Py_CLEAR(self->shown);
  Py_CLEAR(self->views);
  Py_CLEAR(self->hidden);
  Py_CLEAR(self->master);
  Py_CLEAR(self->pending);
  Py_CLEAR(self->flushed);
  Py_CLEAR(self->bucket);
  type->tp_free(obj);
  Py_DECREF(type);
}

PyMemberDef post_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(PostHook, vectorcall), READONLY, nullptr},
    {nullptr, 0, 0, 0, nullptr}};

PyType_Slot post_slots[] = {
    {Py_tp_call, reinterpret_cast<void*>(PyVectorcall_Call)},
    {Py_tp_members, post_members},
    {Py_tp_init, reinterpret_cast<void*>(post_init)},
    {Py_tp_dealloc, reinterpret_cast<void*>(post_dealloc)},
    {Py_tp_new, reinterpret_cast<void*>(PyType_GenericNew)},
    {Py_tp_doc,
     const_cast<char*>("The intake's post-accumulate-grad hook for one param (grad_hooks.cpp).")},
    {0, nullptr}};
PyType_Spec post_spec = {"accumkernels._C.PostHook", sizeof(PostHook), 0,
                         Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL, post_slots};

// Whether every params[i].grad is views[i] (the same object): -1 on error.
int grads_are(PyObject* params, PyObject* views) {
  if (!PyList_Check(params) || !PyList_Check(views)) {
    PyErr_SetString(PyExc_TypeError, "grads_are: params and views must be lists");
    return -1;
  }
  const Py_ssize_t n = PyList_GET_SIZE(params);
  if (PyList_GET_SIZE(views) != n) return 0;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* g = PyObject_GetAttr(PyList_GET_ITEM(params, i), s_grad);
    if (g == nullptr) return -1;
    const bool same = g == PyList_GET_ITEM(views, i);
    Py_DECREF(g);
    if (!same) return 0;
  }
  return 1;
}

}  // namespace

void bind_grad_hooks(pybind11::module_& m) {
  namespace py = pybind11;
  const char* names[] = {"grad",    "fast",    "views",       "showable",   "hidden",
                         "pending", "flushed", "before_grad", "after_grad", "launch_held",
                         "add_"};
  PyObject** slots[] = {&s_grad,    &s_fast,    &s_views,       &s_showable,   &s_hidden,
                        &s_pending, &s_flushed, &s_before_grad, &s_after_grad, &s_launch_held,
                        &s_add_};
  for (size_t k = 0; k < sizeof(names) / sizeof(names[0]); ++k) {
    *slots[k] = PyUnicode_InternFromString(names[k]);
    if (*slots[k] == nullptr) throw py::error_already_set();
  }
  PyObject* pre = PyType_FromSpec(&pre_spec);
  if (pre == nullptr) throw py::error_already_set();
  m.attr("PreHook") = py::reinterpret_steal<py::object>(pre);
  PyObject* post = PyType_FromSpec(&post_spec);
  if (post == nullptr) throw py::error_already_set();
  m.attr("PostHook") = py::reinterpret_steal<py::object>(post);
  m.def(
      "grads_are",
      [](py::handle params, py::handle views) {
        const int r = grads_are(params.ptr(), views.ptr());
        if (r < 0) throw py::error_already_set();
        return r == 1;
      },
      py::arg("params"), py::arg("views"),
      "Whether every params[i].grad is views[i] (the same object): one read of each .grad.");
}

}  // namespace accumkernels
