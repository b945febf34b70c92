"""Code generation: Triton kernels for the schedules the search chooses. (docstring WIP)"""
