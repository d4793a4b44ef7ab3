"""What the benchmark scripts share and never run on their own.

Models (``gpt``, ``resnet50``, ``llama``, ``llama_block``), the train step of each (model,
precision configuration) pair (``setups``), the steps of the loss-scaling
study (``loss_scale_steps``), compiler figures on any machine (``figures``),
figures on a GPU (``gpu_figures``), the deviceless GPU-target report and its
roofline model (``deviceless``), and the header every results file opens with
(``results``). The scripts in ``benchmarks/`` import it with ``benchmarks/`` on
``sys.path`` (which running one as ``python benchmarks/<script>.py`` does).
"""
