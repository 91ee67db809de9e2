"""The native backend: a C++ decode kernel for CPU through the XLA FFI (`backend`: the Python
side; `build`: its build; kernel.h and handlers.cc: the C++)."""
