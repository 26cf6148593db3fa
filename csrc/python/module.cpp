// The Python extension module deformconv._C. It holds no functions: importing it loads the
// shared library, whose static initialisers register the ops with the PyTorch dispatcher.
// Python reaches them as torch.ops.deformconv.*.

#include <Python.h>

static PyModuleDef deformconv_module = {PyModuleDef_HEAD_INIT, "_C",
                                        "deformconv operator library", -1, nullptr};

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&deformconv_module); }
