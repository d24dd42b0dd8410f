"""Loss scaling: TF1's loss scales and ``MixedPrecisionLossScaleOptimizer`` as optax.

A concern beside the pipeline: it decides the loss scale, whether a step's gradients are
finite and whether the step is applied. Reads only the float32 region mark (``trace``: the
optimizer's update runs in one) and the NNX support. Hands on the optimizer and its state to
the user and to ``seed.py`` (TF1's ``enable_mixed_precision_graph_rewrite``).
"""
