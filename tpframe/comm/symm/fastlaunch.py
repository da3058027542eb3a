"""A minimal C launcher for the symm data kernels: one cuLaunchKernel, arguments by vectorcall.

Triton's generic launcher parses ~27 Python arguments, checks the CUDA context and handles hooks,
scratch buffers, clusters and PDL on every call: most of a small collective's eager cost (benchmarks/comm.py;
benchmarks/RESULTS.md, 'Numbers moved out of code comments'). The data kernels
share one signature (int64 x4, int32 x3, then Triton's two scratch pointers, unused here: 0), so
this launcher takes exactly those values. It is compiled on first use with Triton's own build helper
(the way Triton builds its launchers); if that is not possible, launch.py keeps Triton's launcher.
"""

from __future__ import annotations

import functools

SOURCE = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>

typedef int (*cu_launch_t)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                           void*, void**, void**);
static cu_launch_t cu_launch = NULL;

/* launch(function, grid, block, shared_bytes, stream, x_addr, out_addr, buf_table, pad_table, n, chunk, rank) */
static PyObject* launch(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 12) {
    PyErr_Format(PyExc_TypeError, "launch takes 12 arguments, got %zd", nargs);
    return NULL;
  }
  if (cu_launch == NULL) {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (lib == NULL) { PyErr_SetString(PyExc_RuntimeError, "cannot dlopen libcuda.so.1"); return NULL; }
    cu_launch = (cu_launch_t)dlsym(lib, "cuLaunchKernel");
    if (cu_launch == NULL) { PyErr_SetString(PyExc_RuntimeError, "no cuLaunchKernel in libcuda"); return NULL; }
  }
  void* function = PyLong_AsVoidPtr(args[0]);
  unsigned grid = (unsigned)PyLong_AsUnsignedLong(args[1]);
  unsigned block = (unsigned)PyLong_AsUnsignedLong(args[2]);
  unsigned shared = (unsigned)PyLong_AsUnsignedLong(args[3]);
  void* stream = PyLong_AsVoidPtr(args[4]);
  int64_t p64[4];
  int32_t p32[3];
  uint64_t scratch[2] = {0, 0};
  for (int i = 0; i < 4; ++i) p64[i] = PyLong_AsLongLong(args[5 + i]);
  for (int i = 0; i < 3; ++i) p32[i] = (int32_t)PyLong_AsLong(args[9 + i]);
  if (PyErr_Occurred()) return NULL;
  void* params[9] = {&p64[0], &p64[1], &p64[2], &p64[3], &p32[0], &p32[1], &p32[2], &scratch[0], &scratch[1]};
  int err = cu_launch(function, grid, 1, 1, block, 1, 1, shared, stream, params, NULL);
  if (err != 0) {
    PyErr_Format(PyExc_RuntimeError, "cuLaunchKernel failed with CUDA error %d", err);
    return NULL;
  }
  Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
  {"launch", (PyCFunction)(void (*)(void))launch, METH_FASTCALL, "one cuLaunchKernel of a symm data kernel"},
  {NULL, NULL, 0, NULL},
};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "tpframe_symm_launch", NULL, -1, methods};
PyMODINIT_FUNC PyInit_tpframe_symm_launch(void) { return PyModule_Create(&module); }
"""

# The kernel parameters SOURCE passes, in order (PTX types): the runtime args, then Triton's scratch pointers.
PTX_PARAMS = ("u64", "u64", "u64", "u64", "u32", "u32", "u32", "u64", "u64")


@functools.lru_cache(maxsize=1)
def module():
    """The compiled launcher module (cached by Triton's cache manager across processes)."""
    from triton.runtime.build import compile_module_from_src

    return compile_module_from_src(SOURCE, "tpframe_symm_launch")


def ptx_params(ptx: str) -> tuple[str, ...]:
    """The parameter types of the (single) .entry in `ptx`, e.g. ('u64', 'u32', ...)."""
    start = ptx.index(".entry")
    head = ptx[start : ptx.index(")", start)]
    return tuple(line.split()[1].lstrip(".") for line in head.splitlines() if line.strip().startswith(".param"))
