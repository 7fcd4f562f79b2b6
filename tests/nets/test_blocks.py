"""Every network block's footprint against the tensors it actually creates (nets/blocks.py).

The memory estimate (memory/estimate.py) never looks inside a block: it walks the network with
``output_spatial_shape`` and sums what each block reports: ``feature_map_elements`` (a training
step keeps them for backward), ``inference_live_elements`` (a forward pass's peak),
``largest_tensor_elements`` (whether a stage runs in depth slabs) and ``forward_macs`` (the step's
FLOPs). Each block is built on a tiny odd-sized input and traced two ways:

- a graph trace with every Keras layer call recorded (``_layer_trace``): a block creates its leaf
  layers' outputs and the outputs of the ops in its own ``call`` (a two-input conv's sum); the
  graph's convolutions give the multiply-adds;
- an eager inference pass under TensorFlow's op callback (``_live_peak``): each op's output buffer
  is followed until Python drops the last tensor that views it, and the most elements alive at
  once, the block's inputs excepted, is what ``inference_live_elements`` promises. (The op
  callback is TensorFlow's internal ``op_callbacks`` API, which its debugger's dumps use.)

The blocks are discovered from the module: a new block fails ``test_every_block_has_cases`` until
it has a case here, and a new footprint method fails ``test_every_public_block_method_is_checked``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import weakref

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework import op_callbacks

from bigmem.nets import blocks

# Ops whose output is a view of their first input's buffer (no new memory).
VIEW_OPS = frozenset({"Identity", "IdentityN", "Reshape", "ExpandDims", "Squeeze"})
# What a footprint test checks; every other public method a block defines is Keras's interface.
FOOTPRINT_METHODS = ("feature_map_elements", "inference_live_elements", "largest_tensor_elements", "forward_macs",
                     "output_spatial_shape")
KERAS_METHODS = ("call", "get_config")


@dataclasses.dataclass(frozen=True)
class Case:
    """A block, its inputs' per-sample shapes ``(D, H, W, C)``, and what its footprint methods take."""

    id: str
    cls: type
    kwargs: dict
    inputs: tuple[tuple[int, ...], ...]  # one shape, or [x, skip]
    in_channels: int | None = None  # a block's (not a stage's) second argument
    known_bug: str | None = None  # the footprint tests are expected to fail, for this reason

    def make(self) -> keras.layers.Layer:
        return self.cls(**self.kwargs)

    @property
    def spatial_shape(self) -> tuple[int, ...]:
        """What the footprint methods take: the (first) input's ``(D, H, W)``."""
        return self.inputs[0][:3]

    @property
    def args(self) -> tuple:
        """The arguments of ``forward_macs`` and ``inference_live_elements``."""
        return (self.spatial_shape,) if self.in_channels is None else (self.spatial_shape, self.in_channels)


STRIDED_ODD = ("a stride-2 'same' convolution of 9 planes gives TensorFlow's ceil(9 / 2) = 5, but the blocks count "
               "s // 2 = 4 (_Block._out_shape): the footprint is right only for sizes divisible by the "
               "stride, which UNet3D's size contract guarantees")

CASES = [
    Case("conv-instance", blocks.ConvNormAct, dict(filters=6), ((9, 10, 11, 3),), 3),
    Case("conv-group-leaky-bias", blocks.ConvNormAct, dict(filters=6, norm="group", groups=2, activation="leaky_relu",
                                                           use_bias=True), ((9, 10, 11, 3),), 3),
    Case("conv-batch-strided", blocks.ConvNormAct, dict(filters=6, strides=2, norm="batch"), ((10, 8, 12, 3),), 3),
    Case("conv-no-norm", blocks.ConvNormAct, dict(filters=6, norm="none"), ((9, 10, 11, 3),), 3),
    Case("conv-two-inputs", blocks.ConvNormAct, dict(filters=16, num_inputs=2), ((9, 10, 11, 8), (9, 10, 11, 8)),
         16),
    Case("conv-stock-layers", blocks.ConvNormAct, dict(filters=6, stock_layers=True), ((9, 10, 11, 3),), 3),
    Case("conv-strided-odd", blocks.ConvNormAct, dict(filters=6, strides=2), ((9, 10, 11, 3),), 3,
         known_bug=STRIDED_ODD),
    Case("residual-identity", blocks.ResidualBlock, dict(filters=6, in_filters=6), ((9, 10, 11, 6),), 6),
    Case("residual-projection-batch", blocks.ResidualBlock, dict(filters=6, in_filters=3, strides=2, norm="batch"),
         ((10, 8, 12, 3),), 3),
    # ResNet-D shortcuts (nnU-Net's BasicBlockD): the pool and a bias-free 1x1x1 conv + norm; the pool alone; the
    # conv alone; per axis.
    Case("residual-pooled-projection", blocks.ResidualBlock, dict(filters=6, in_filters=3, strides=2,
                                                                  pooled_shortcut=True), ((10, 8, 12, 3),), 3),
    Case("residual-pooled-only", blocks.ResidualBlock, dict(filters=6, in_filters=6, strides=2, pooled_shortcut=True,
                                                            activation="leaky_relu", use_bias=True),
         ((10, 8, 12, 6),), 6),
    Case("residual-pooled-channels", blocks.ResidualBlock, dict(filters=6, in_filters=3, pooled_shortcut=True),
         ((9, 10, 11, 3),), 3),
    Case("residual-pooled-per-axis", blocks.ResidualBlock, dict(filters=6, in_filters=3, strides=(1, 2, 2),
                                                                kernel_size=(1, 3, 3), pooled_shortcut=True,
                                                                norm="batch"), ((9, 8, 12, 3),), 3),
    Case("encoder-full-resolution", blocks.EncoderStage, dict(filters=4, in_filters=1), ((9, 10, 11, 1),)),
    Case("encoder-maxpool", blocks.EncoderStage, dict(filters=4, in_filters=2, downsampling="maxpool"),
         ((9, 10, 11, 2),)),
    Case("encoder-strided-residual", blocks.EncoderStage, dict(filters=4, in_filters=2, downsampling="strided",
                                                               residual=True), ((10, 8, 12, 2),)),
    # nnU-Net's residual encoder: the stem, then a ResNet-D block; a strided stage of them, per axis.
    Case("encoder-stem-resenc", blocks.EncoderStage, dict(filters=4, in_filters=1, num_blocks=1, residual=True,
                                                          pooled_shortcut=True, stem=True), ((9, 10, 11, 1),)),
    Case("encoder-strided-resenc", blocks.EncoderStage, dict(filters=8, in_filters=4, downsampling="strided",
                                                             scale=(1, 2, 2), kernel_size=(1, 3, 3), residual=True,
                                                             pooled_shortcut=True), ((9, 8, 12, 4),)),
    Case("encoder-maxpool-resenc", blocks.EncoderStage, dict(filters=8, in_filters=4, downsampling="maxpool",
                                                             residual=True, pooled_shortcut=True),
         ((10, 8, 12, 4),)),
    Case("decoder-two-input-skip", blocks.DecoderStage, dict(filters=16, in_filters=32, num_blocks=1),
         ((5, 4, 3, 32), (10, 8, 6, 16))),
    Case("decoder-concatenated", blocks.DecoderStage, dict(filters=8, in_filters=16), ((5, 4, 3, 16), (10, 8, 6, 8))),
    Case("decoder-residual", blocks.DecoderStage, dict(filters=8, in_filters=16, residual=True),
         ((5, 4, 3, 16), (10, 8, 6, 8))),
    Case("decoder-stock-layers", blocks.DecoderStage, dict(filters=8, in_filters=16, num_blocks=1, stock_layers=True),
         ((5, 4, 3, 16), (10, 8, 6, 8))),
]


def _block_classes() -> list[type]:
    """The public Keras layers nets/blocks.py defines."""
    return [value for name, value in vars(blocks).items()
            if isinstance(value, type) and issubclass(value, keras.layers.Layer)
            and value.__module__ == blocks.__name__ and not name.startswith("_")]


def _params(*, method: str | None = None, footprint: bool = True) -> list:
    """The cases (those whose block has ``method``), a footprint test's known bugs marked as strict xfails."""
    params = []
    for case in CASES:
        if method is not None and not hasattr(case.cls, method):
            continue
        marks = [pytest.mark.xfail(strict=True, reason=case.known_bug)] if footprint and case.known_bug else []
        params.append(pytest.param(case, id=case.id, marks=marks))
    return params


def _inputs(case: Case, batch: int = 1) -> list[tf.Tensor]:
    return [tf.random.stateless_normal((batch, *shape), seed=[i, 1]) for i, shape in enumerate(case.inputs)]


def _call(block, inputs, training):
    return block(inputs if len(inputs) > 1 else inputs[0], training=training)


def _elements(t) -> int:
    """Per-sample elements of a ``(batch, ...)`` tensor."""
    return math.prod(t.shape[1:])


# ---- the traces ----------------------------------------------------------------------------------


@dataclasses.dataclass
class _LayerCall:
    """One Keras layer call in a traced graph: the graph ops [start, end) it created, and its sublayers' calls."""

    layer: keras.layers.Layer
    start: int
    end: int = 0
    children: list = dataclasses.field(default_factory=list)
    outputs: list = dataclasses.field(default_factory=list)


def _layer_trace(block, inputs) -> tuple[tf.Graph, _LayerCall]:
    """The graph of ``block(inputs, training=True)`` and the tree of the layer calls in it (the block's at the root)."""
    original = keras.layers.Layer.__call__
    stack: list[_LayerCall] = []
    calls: list[_LayerCall] = []

    def recording(layer, *args, **kwargs):
        call = _LayerCall(layer, len(tf.compat.v1.get_default_graph().get_operations()))
        (stack[-1].children if stack else calls).append(call)
        stack.append(call)
        try:
            out = original(layer, *args, **kwargs)
        finally:
            stack.pop()
        call.end = len(tf.compat.v1.get_default_graph().get_operations())
        call.outputs = tf.nest.flatten(out)
        return out

    function = tf.function(lambda *xs: _call(block, list(xs), training=True))
    keras.layers.Layer.__call__ = recording
    try:
        graph = function.get_concrete_function(*(tf.TensorSpec(x.shape, x.dtype) for x in inputs)).graph
    finally:
        keras.layers.Layer.__call__ = original
    (root,) = calls
    return graph, root


def _created(graph: tf.Graph, call: _LayerCall) -> list[tf.Tensor]:
    """The feature maps a layer call creates: a leaf layer's outputs; a block's own ops' outputs and its sublayers'."""
    if not call.children:
        return list(call.outputs)
    ops = graph.get_operations()
    in_sublayers = {i for child in call.children for i in range(child.start, child.end)}
    own = [t for i in range(call.start, call.end) if i not in in_sublayers
           and ops[i].type not in VIEW_OPS | {"ReadVariableOp", "Const", "NoOp"}
           for t in ops[i].outputs if t.shape.rank == 5 and t.dtype.is_floating]
    return own + [t for child in call.children for t in _created(graph, child)]


def _conv_macs(graph: tf.Graph) -> tuple[int, set[str]]:
    """Multiply-adds of the graph's 3-D convolutions, and the types of any other matrix kernels in it."""
    total = 0
    for op in graph.get_operations():
        kernel = op.inputs[1].shape if len(op.inputs) > 1 else None
        if op.type == "Conv3D":  # kernel (k, k, k, C_in, C_out): each output voxel takes all of it
            total += math.prod(kernel) * math.prod(op.outputs[0].shape[1:4])
        elif op.type == "Conv3DBackpropInputV2":  # a transposed conv: each input voxel meets every tap
            total += math.prod(kernel) * math.prod(op.inputs[2].shape[1:4])
    others = {op.type for op in graph.get_operations()
              if ("Conv" in op.type or "MatMul" in op.type) and op.type not in ("Conv3D", "Conv3DBackpropInputV2")}
    return total, others


def _live_peak(block, inputs, min_elements: int) -> int:
    """The most elements alive at once in an eager inference pass of ``block``, its inputs excepted.

    Every op's output of at least ``min_elements`` elements (a feature map; not a statistic or a
    shape) is a buffer; a view's output joins its input's. A buffer is alive while Python holds a
    tensor of it, as in the eager pass the estimate models (each tensor freed after its last use).
    """
    buffers: list[tuple[int, list[weakref.ref]]] = []
    owner: dict[int, tuple[weakref.ref, int]] = {}  # id(tensor) -> (its weakref, its buffer)
    peak = 0

    def buffer_of(t) -> int | None:
        ref, index = owner.get(id(t), (None, None))
        return index if ref is not None and ref() is t else None

    def callback(op_type, op_inputs, attrs, outputs, op_name=None, graph=None):
        nonlocal peak
        op_type = op_type.decode() if isinstance(op_type, bytes) else op_type
        if graph is not None or op_type == "ReadVariableOp":  # a variable's value is the variable's memory
            return None
        for t in outputs or ():
            index = buffer_of(op_inputs[0]) if op_type in VIEW_OPS and op_inputs else None
            if index is None and op_type not in VIEW_OPS and t.shape.num_elements() >= min_elements:
                buffers.append((t.shape.num_elements(), []))
                index = len(buffers) - 1
            if index is not None:
                ref = weakref.ref(t)
                buffers[index][1].append(ref)
                owner[id(t)] = (ref, index)
        peak = max(peak, sum(n for n, refs in buffers if any(ref() is not None for ref in refs)))
        return None

    op_callbacks.add_op_callback(callback)
    try:
        _call(block, inputs, training=False)
    finally:
        op_callbacks.remove_op_callback(callback)
    return peak


@dataclasses.dataclass
class _Traced:
    block: keras.layers.Layer
    inputs: list[tf.Tensor]
    output: tf.Tensor
    created: list[tf.Tensor]  # graph tensors, batch 1
    macs: int
    other_kernels: set[str]
    live_peak: int


@functools.lru_cache(maxsize=None)
def _built(case_id: str) -> _Traced:
    """The case's block, built on batch-1 inputs and traced once for every test."""
    case = next(c for c in CASES if c.id == case_id)
    keras.utils.set_random_seed(0)
    block = case.make()
    inputs = _inputs(case)
    output = _call(block, inputs, training=False)
    graph, root = _layer_trace(block, inputs)
    created = _created(graph, root)
    macs, others = _conv_macs(graph)
    # A feature map has at least one channel of the smallest resolution's voxels; statistics have
    # at most a few per channel (the cases have far more voxels than channels).
    smallest = min(math.prod(t.shape[1:4]) for t in created)
    return _Traced(block, inputs, output, created, macs, others, _live_peak(block, inputs, smallest))


# ---- coverage ------------------------------------------------------------------------------------


def test_every_block_has_cases():
    covered = {case.cls for case in CASES}
    assert set(_block_classes()) - covered == set()


def test_every_public_block_method_is_checked():
    """A block's public methods are Keras's or a footprint method these tests check."""
    for cls in _block_classes():
        defined = {name for klass in cls.__mro__ if klass.__module__ == blocks.__name__
                   for name, value in vars(klass).items() if callable(value) and not name.startswith("_")}
        assert defined - set(FOOTPRINT_METHODS) - set(KERAS_METHODS) == set(), cls.__name__


def test_the_traces_find_the_tensors_counted_by_hand():
    """The instruments themselves, on blocks small enough to count: what they find is the block's, all of it."""
    decoder = _built("decoder-concatenated")  # upsampled, concatenated with the skip, then two conv + norm-act
    assert [tuple(t.shape[1:]) for t in decoder.created] == [(10, 8, 6, 8), (10, 8, 6, 16)] + [(10, 8, 6, 8)] * 4
    two_inputs = _built("conv-two-inputs")
    assert two_inputs.created[0].op.type == "AddV2"  # the sum of its two convolutions, outside any layer
    plain = _built("conv-no-norm")  # at the ReLU: the convolution's output and the ReLU's
    assert plain.live_peak == 2 * 6 * 9 * 10 * 11


# ---- the footprint against the trace -------------------------------------------------------------


@pytest.mark.parametrize("case", _params())
def test_feature_map_elements_are_the_tensors_it_creates(case):
    traced = _built(case.id)
    assert traced.block.feature_map_elements(case.spatial_shape) == sum(map(_elements, traced.created))


@pytest.mark.parametrize("case", _params())
def test_forward_macs_are_its_convolutions(case):
    traced = _built(case.id)
    assert traced.other_kernels == set()  # only 3-D convolutions multiply-add
    assert traced.block.forward_macs(*case.args) == traced.macs


@pytest.mark.parametrize("case", _params())
def test_inference_live_elements_are_the_eager_peak(case):
    traced = _built(case.id)
    assert traced.block.inference_live_elements(*case.args) == traced.live_peak


@pytest.mark.parametrize("case", _params(method="largest_tensor_elements"))
def test_largest_tensor_elements_is_the_largest_it_reads_or_creates(case):
    traced = _built(case.id)
    largest = max(map(_elements, [*traced.inputs, *traced.created]))
    assert traced.block.largest_tensor_elements(case.spatial_shape) == largest


@pytest.mark.parametrize("case", _params(method="output_spatial_shape"))
def test_output_spatial_shape_is_the_outputs(case):
    traced = _built(case.id)
    assert tuple(traced.block.output_spatial_shape(case.spatial_shape)) == tuple(traced.output.shape[1:4])


def test_the_per_sample_counts_do_not_depend_on_the_batch():
    """The footprint is per sample: a batch of 3 makes each traced tensor 3 times larger, nothing else."""
    case = next(c for c in CASES if c.id == "decoder-concatenated")
    traced = _built(case.id)
    graph, root = _layer_trace(traced.block, _inputs(case, batch=3))
    created = _created(graph, root)
    assert [t.shape[0] for t in created] == [3] * len(traced.created)
    assert sum(map(_elements, created)) == sum(map(_elements, traced.created))


# ---- serialisation -------------------------------------------------------------------------------


@pytest.mark.parametrize("case", _params(footprint=False))
def test_config_round_trip_rebuilds_the_same_block(case):
    traced = _built(case.id)
    again = type(traced.block).from_config(traced.block.get_config())
    assert again.get_config() == traced.block.get_config()
    _call(again, traced.inputs, training=False)
    again.set_weights(traced.block.get_weights())
    np.testing.assert_array_equal(np.asarray(_call(again, traced.inputs, training=False)), np.asarray(traced.output))


@pytest.mark.parametrize("case", _params(footprint=False))
def test_keras_serialisation_round_trip(case):
    """What a saved model holds for the block: its registered name and config, back to the same class."""
    block = case.make()  # unbuilt: a block builds its sublayers on its first call (it has no build())
    loaded = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(block))
    assert type(loaded) is type(block)
    assert loaded.get_config() == block.get_config()
