"""Lesson support: the models, data and experiments the notebooks use; not needed to measure your own training.

    from gpukit.lessons.data import digits_batch       # the digits, shipped in gpukit/lessons/datasets/
    from gpukit.lessons.models import MLP, ConvNet, TinyGPT
    from gpukit.lessons.techniques import run_matrix   # every technique on the reference models
"""
