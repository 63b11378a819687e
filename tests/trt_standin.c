/* A stand-in for a TensorRT Python binding, for tests only: what NVIDIA's pybind11 trampolines
 * do, in C, with the same object layout (the C++ object's address in the first word after the
 * Python header, a virtual table with RTTI before it, IVersionedInterface's four slots first),
 * so that gpubudget's probe and the tests drive it exactly as they drive the real ones.
 *
 * Built by tests/trt_standin.py with -DSTANDIN_NAME=<module> and one of:
 *   -DSTREAM_THIRD   allocate_async(size, alignment, stream, flags), as TensorRT 10's bindings
 *                    (python/src/infer/pyCore.cpp, PyGpuAsyncAllocator::allocateAsync) call it;
 *   -DDROPS_STREAM   allocate_async(size, alignment, flags, 0) and reallocate_output_async(...,
 *                    0): orders that cannot be established (the stream never arrives);
 *   -DDROPS_FREE_STREAM  allocate_async(size, alignment, flags, stream) as TensorRT-RTX, but
 *                    deallocate_async(memory, 0): a free whose stream never arrives;
 *   -DTRT8           TensorRT 8.5/8.6's classes: no IVersionedInterface, so an IGpuAllocator of
 *                    six virtual methods (allocate, free, two destructors, reallocate,
 *                    deallocate) and an IOutputAllocator of five (getInterfaceVersion,
 *                    reallocateOutput, notifyShape, two destructors); no IGpuAsyncAllocator.
 *                    Its deleting destructors count their calls (deletions()): a probe that
 *                    calls one would free the object under pybind11's feet.
 * The other variants' IOutputAllocator has TensorRT 10's three slots (reallocateOutput,
 * reallocateOutputAsync, notifyShape); TensorRT-RTX 1.7's has two (no reallocateOutput).
 * Each class's RTTI is Itanium's: a name, and (single inheritance) the base class's RTTI, up
 * to nvinfer1::IVersionedInterface in TensorRT 10's layout, as in NVIDIA's binding.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdio.h>

#define STR2(x) #x
#define STR(x) STR2(x)
#define CAT2(a, b) a##b
#define CAT(a, b) CAT2(a, b)

typedef struct { void *const *vptr; PyObject *self; } Cpp; /* the "C++ object" */
typedef struct { PyObject_HEAD Cpp *cpp; } Instance;
/* Itanium RTTI: __si_class_type_info {vtable, name, base}; a root class has no base (0 here) */
typedef struct TypeInfo { const void *vtable; const char *name; const struct TypeInfo *base; }
    TypeInfo;
typedef struct { int32_t nbDims; int64_t d[8]; } Dims;

static long deletions = 0; /* calls of a deleting destructor (TRT8) */

#if defined(TRT8)
static const TypeInfo gpu_allocator_rtti = {0, "N8nvinfer113IGpuAllocatorE", 0};
static const TypeInfo allocator_rtti = {0, "N8tensorrt14PyGpuAllocatorE", &gpu_allocator_rtti};
static const TypeInfo output_base_rtti = {0, "N8nvinfer116IOutputAllocatorE", 0};
#else
static const TypeInfo versioned_rtti = {0, "N8nvinfer119IVersionedInterfaceE", 0};
static const TypeInfo gpu_allocator_rtti = {0, "N8nvinfer15v_1_013IGpuAllocatorE",
                                            &versioned_rtti};
static const TypeInfo async_rtti = {0, "N8nvinfer15v_1_018IGpuAsyncAllocatorE",
                                    &gpu_allocator_rtti};
static const TypeInfo allocator_rtti = {0, "N8tensorrt19PyGpuAsyncAllocatorE", &async_rtti};
static const TypeInfo output_base_rtti = {0, "N8nvinfer15v_1_016IOutputAllocatorE",
                                          &versioned_rtti};
#endif
static const TypeInfo output_rtti = {0, "N8tensorrt17PyOutputAllocatorE", &output_base_rtti};

/* Call a Python method under the GIL; an exception is printed as TensorRT prints it. */
static void *call_pointer(Cpp *cpp, const char *method, const char *format, ...)
{
    PyGILState_STATE gil = PyGILState_Ensure();
    void *answer = NULL;
    va_list args;
    va_start(args, format);
    PyObject *callable = PyObject_GetAttrString(cpp->self, method);
    PyObject *arguments = callable ? Py_VaBuildValue(format, args) : NULL;
    va_end(args);
    PyObject *result = arguments ? PyObject_CallObject(callable, arguments) : NULL;
    if (result == NULL) {
        PyErr_Clear();
        fprintf(stderr, "[ERROR] Exception caught in %s()\n", method);
    } else if (result != Py_None) {
        unsigned long long value = PyLong_AsUnsignedLongLong(result);
        if (PyErr_Occurred()) {
            PyErr_Clear();
            fprintf(stderr, "[ERROR] Return value of %s() could not be interpreted as an int\n",
                    method);
        } else {
            answer = (void *)(uintptr_t)value;
        }
    } else {
        fprintf(stderr, "[ERROR] Return value of %s() could not be interpreted as an int\n",
                method);
    }
    Py_XDECREF(result);
    Py_XDECREF(arguments);
    Py_XDECREF(callable);
    PyGILState_Release(gil);
    return answer;
}

static int nothing(Cpp *cpp) { (void)cpp; return 0; }
static void destroy(Cpp *cpp) { (void)cpp; }
static void destroy_and_delete(Cpp *cpp) { (void)cpp; deletions++; } /* counted, not freed */

static void *allocate_async(Cpp *cpp, uint64_t size, uint64_t alignment, uint32_t flags,
                            void *stream)
{
#if defined(STREAM_THIRD)
    return call_pointer(cpp, "allocate_async", "(KKKI)", (unsigned long long)size,
                        (unsigned long long)alignment, (unsigned long long)(uintptr_t)stream,
                        (unsigned int)flags);
#elif defined(DROPS_STREAM)
    (void)stream;
    return call_pointer(cpp, "allocate_async", "(KKIK)", (unsigned long long)size,
                        (unsigned long long)alignment, (unsigned int)flags, 0ULL);
#elif defined(DROPS_FREE_STREAM)
    return call_pointer(cpp, "allocate_async", "(KKIK)", (unsigned long long)size,
                        (unsigned long long)alignment, (unsigned int)flags,
                        (unsigned long long)(uintptr_t)stream);
#elif defined(TRT8)
    (void)stream; /* TensorRT 8 has no stream-ordered allocation: allocate() */
    return call_pointer(cpp, "allocate", "(KKI)", (unsigned long long)size,
                        (unsigned long long)alignment, (unsigned int)flags);
#else
#error "choose STREAM_THIRD, DROPS_STREAM, DROPS_FREE_STREAM or TRT8"
#endif
}

static void *allocate(Cpp *cpp, uint64_t size, uint64_t alignment, uint32_t flags)
{
    return allocate_async(cpp, size, alignment, flags, NULL); /* as IGpuAsyncAllocator does */
}

static void *reallocate(Cpp *cpp, void *address, uint64_t alignment, uint64_t size)
{
    return call_pointer(cpp, "reallocate", "(KKK)", (unsigned long long)(uintptr_t)address,
                        (unsigned long long)alignment, (unsigned long long)size);
}

static int deallocate_async(Cpp *cpp, void *memory, void *stream)
{
#if defined(DROPS_FREE_STREAM)
    stream = NULL;
#endif
#if defined(TRT8)
    (void)stream;
    return call_pointer(cpp, "deallocate", "(K)", (unsigned long long)(uintptr_t)memory) != NULL;
#else
    return call_pointer(cpp, "deallocate_async", "(KK)", (unsigned long long)(uintptr_t)memory,
                        (unsigned long long)(uintptr_t)stream) != NULL;
#endif
}

static int deallocate(Cpp *cpp, void *memory) { return deallocate_async(cpp, memory, NULL); }

static void *reallocate_output(Cpp *cpp, const char *name, void *memory, uint64_t size,
                               uint64_t alignment)
{
    return call_pointer(cpp, "reallocate_output", "(sKKK)", name,
                        (unsigned long long)(uintptr_t)memory, (unsigned long long)size,
                        (unsigned long long)alignment);
}

#if !defined(TRT8) /* TensorRT 8 has no reallocateOutputAsync */
static void *reallocate_output_async(Cpp *cpp, const char *name, void *memory, uint64_t size,
                                     uint64_t alignment, void *stream)
{
#if defined(DROPS_STREAM)
    stream = NULL;
#endif
    return call_pointer(cpp, "reallocate_output_async", "(sKKKK)", name,
                        (unsigned long long)(uintptr_t)memory, (unsigned long long)size,
                        (unsigned long long)alignment, (unsigned long long)(uintptr_t)stream);
}
#endif

static void notify_shape(Cpp *cpp, const char *name, const Dims *dims)
{
    PyGILState_STATE gil = PyGILState_Ensure();
    int rank = dims->nbDims < 0 || dims->nbDims > 8 ? 0 : dims->nbDims;
    PyObject *shape = PyTuple_New(rank);
    for (int i = 0; shape && i < rank; i++)
        PyTuple_SET_ITEM(shape, i, PyLong_FromLongLong(dims->d[i]));
    PyObject *result = shape ? PyObject_CallMethod(cpp->self, "notify_shape", "(sO)", name,
                                                   shape) : NULL;
    if (result == NULL) {
        PyErr_Clear();
        fprintf(stderr, "[ERROR] Exception caught in notifyShape()\n");
    }
    Py_XDECREF(result);
    Py_XDECREF(shape);
    PyGILState_Release(gil);
}

/* offset to top, RTTI, then the slots; a 0 after the last one */
#if defined(TRT8)
static void *const allocator_vtable[] = {
    0, (void *)&allocator_rtti, (void *)allocate, (void *)deallocate, (void *)destroy,
    (void *)destroy_and_delete, (void *)reallocate, (void *)deallocate, 0};
static void *const output_vtable[] = {
    0, (void *)&output_rtti, (void *)nothing, (void *)reallocate_output, (void *)notify_shape,
    (void *)destroy, (void *)destroy_and_delete, 0};
#else
static void *const allocator_vtable[] = {
    0, (void *)&allocator_rtti, (void *)nothing, (void *)nothing, (void *)destroy,
    (void *)destroy_and_delete, (void *)allocate, (void *)reallocate, (void *)deallocate,
    (void *)allocate_async, (void *)deallocate_async, 0};
static void *const output_vtable[] = {
    0, (void *)&output_rtti, (void *)nothing, (void *)nothing, (void *)destroy,
    (void *)destroy_and_delete, (void *)reallocate_output, (void *)reallocate_output_async,
    (void *)notify_shape, 0};
#endif

static int init_with(PyObject *self, void *const *vtable)
{
    Instance *instance = (Instance *)self;
    if (instance->cpp == NULL) {
        instance->cpp = PyMem_Malloc(sizeof(Cpp));
        if (instance->cpp == NULL) {
            PyErr_NoMemory();
            return -1;
        }
    }
    instance->cpp->vptr = vtable + 2;
    instance->cpp->self = self; /* borrowed, as pybind11's trampolines hold it */
    return 0;
}

static int allocator_init(PyObject *self, PyObject *args, PyObject *kwargs)
{
    (void)args; (void)kwargs;
    return init_with(self, allocator_vtable);
}

static int output_init(PyObject *self, PyObject *args, PyObject *kwargs)
{
    (void)args; (void)kwargs;
    return init_with(self, output_vtable);
}

static void instance_dealloc(PyObject *self)
{
    PyTypeObject *type = Py_TYPE(self);
    PyMem_Free(((Instance *)self)->cpp);
    type->tp_free(self);
    if (type->tp_flags & Py_TPFLAGS_HEAPTYPE)
        Py_DECREF(type);
}

static PyType_Slot allocator_slots[] = {
    {Py_tp_init, allocator_init}, {Py_tp_new, PyType_GenericNew},
    {Py_tp_dealloc, instance_dealloc}, {0, 0}};
static PyType_Slot output_slots[] = {
    {Py_tp_init, output_init}, {Py_tp_new, PyType_GenericNew},
    {Py_tp_dealloc, instance_dealloc}, {0, 0}};
#if defined(TRT8)
#define ALLOCATOR_CLASS ".IGpuAllocator"
#else
#define ALLOCATOR_CLASS ".IGpuAsyncAllocator"
#endif
static PyType_Spec allocator_spec = {
    STR(STANDIN_NAME) ALLOCATOR_CLASS, sizeof(Instance), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE, allocator_slots};
static PyType_Spec output_spec = {
    STR(STANDIN_NAME) ".IOutputAllocator", sizeof(Instance), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE, output_slots};

static PyObject *count_deletions(PyObject *module, PyObject *unused)
{
    (void)module; (void)unused;
    return PyLong_FromLong(deletions);
}

static PyMethodDef functions[] = {
    {"deletions", count_deletions, METH_NOARGS,
     "How many times a deleting destructor was called (TRT8)."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, STR(STANDIN_NAME),
                                        "A stand-in TensorRT binding for tests.", -1,
                                        functions};

PyMODINIT_FUNC CAT(PyInit_, STANDIN_NAME)(void)
{
    PyObject *module = PyModule_Create(&module_def);
    PyObject *allocator = module ? PyType_FromSpec(&allocator_spec) : NULL;
    PyObject *output = allocator ? PyType_FromSpec(&output_spec) : NULL;
    if (output == NULL
#if !defined(TRT8)
        || PyModule_AddObjectRef(module, "IGpuAsyncAllocator", allocator) < 0
#endif
        || PyModule_AddObjectRef(module, "IGpuAllocator", allocator) < 0
        || PyModule_AddObjectRef(module, "IOutputAllocator", output) < 0
#if defined(TRT8)
        || PyModule_AddStringConstant(module, "__version__", "8.6-standin") < 0) {
#else
        || PyModule_AddStringConstant(module, "__version__", "10.0-standin") < 0) {
#endif
        Py_XDECREF(output);
        Py_XDECREF(allocator);
        Py_XDECREF(module);
        return NULL;
    }
    Py_DECREF(output);
    Py_DECREF(allocator);
    return module;
}
