/* The buffers the CPU kernels (cpu_attention.c, cpu_matmul.c) take from Python: each argument as a
   C-contiguous buffer, one of them writable, with a ValueError naming the argument that is not. */

#ifndef EDGEFIRE_CPU_BUFFERS_H
#define EDGEFIRE_CPU_BUFFERS_H

#include <Python.h>

/* Views of objects[0..count-1] (objects[writable] writable); returns how many were taken: count, or
   fewer with the error set. Whatever was taken is given back with release_buffers. */
static int get_buffers(PyObject **objects, Py_buffer *views, int count, int writable, const char *const *names) {
    for (int i = 0; i < count; i++) {
        const int flags = PyBUF_C_CONTIGUOUS | (i == writable ? PyBUF_WRITABLE : 0);
        if (PyObject_GetBuffer(objects[i], &views[i], flags) < 0) {
            PyErr_Format(PyExc_ValueError, "%s must be a contiguous%s buffer", names[i],
                         i == writable ? " writable" : "");
            return i;
        }
    }
    return count;
}

static void release_buffers(Py_buffer *views, int got) {
    for (int i = 0; i < got; i++) PyBuffer_Release(&views[i]);
}

#endif
