"""Kernel choices follow the ISA class oneDNN runs at."""

from __future__ import annotations

import pytest

from bigmem.nets import choices


@pytest.mark.parametrize("detected, cap, want", [
    ("avx512_bf16", None, "avx512_bf16"), ("avx512_bf16", "AVX2", "avx2"), ("avx512_bf16", "avx512_core", "avx512"),
    ("avx2", "AVX512_CORE_BF16", "avx2"), ("amx", "AVX512_CORE_BF16", "avx512_bf16"), ("avx2", "ALL", "avx2"),
    ("avx512", "not-an-isa", "avx512")])
def test_effective_isa_class_is_the_lower_of_cpu_and_cap(detected, cap, want):
    environ = {} if cap is None else {"ONEDNN_MAX_CPU_ISA": cap}
    assert choices.effective_isa_class(detected, environ) == want


def test_every_class_has_choices_with_a_source_and_sane_ranges():
    for name in choices.CLASS_ORDER:
        entry = choices.CHOICES[name]
        assert entry.source
        for (precision, stride), (low, high) in entry.planewise.items():
            assert precision in ("fp32", "bf16")
            assert stride in (1, 2)
            assert 1 <= low <= high


def test_planewise_channels_reads_this_process_class(monkeypatch):
    table = choices.KernelChoices(planewise={("fp32", 2): (8, 16)}, source="test")
    monkeypatch.setattr(choices, "kernel_choices", lambda: ("avx2", table))
    assert choices.planewise_channels("fp32", 2) == (8, 16)
    assert choices.planewise_channels("bf16", 1) is None


def test_conv_layer_follows_the_class_choices(monkeypatch):
    import tensorflow as tf

    from bigmem.nets.conv import Conv3D

    layer = Conv3D(4, 3, padding="same")
    x = tf.zeros((1, 4, 4, 4, 16))
    layer.build(x.shape)
    for name, want in (("avx2", True), ("avx512", False), ("avx512_bf16", False)):
        monkeypatch.setattr(choices, "kernel_choices", lambda name=name: (name, choices.CHOICES[name]))
        assert layer._planewise(x) is want, name  # fp32 stride 1: planewise on AVX2 only


def test_amx_takes_every_bf16_weight_gradient_planewise(monkeypatch):
    """oneDNN's AMX 3-D bf16 weight gradient crashed at 512^2 planes: on amx no channel count reaches it."""
    import tensorflow as tf

    from bigmem.nets.conv import Conv3D

    monkeypatch.setattr(choices, "kernel_choices", lambda: ("amx", choices.CHOICES["amx"]))
    for channels, strides in ((1, 1), (2, 1), (8, 1), (320, 1), (1, 2), (32, 2)):
        layer = Conv3D(4, 3, strides=strides, padding="same", dtype="mixed_bfloat16")
        x = tf.zeros((1, 4, 4, 4, channels), tf.bfloat16)
        assert layer._planewise(x), (channels, strides)
    assert choices.CHOICES["amx"].planewise[("fp32", 2)] == choices.CHOICES["avx512_bf16"].planewise[("fp32", 2)]
    # The head's 1x1x1 and the transposed conv's kernel gradients crashed too: 2-D in bf16 only.
    assert choices.planewise_others("bf16")
    assert not choices.planewise_others("fp32")
    head = Conv3D(3, 1, dtype="mixed_bfloat16")
    assert head._pointwise(tf.zeros((1, 4, 4, 4, 32), tf.bfloat16))
    assert not head._pointwise(tf.zeros((1, 4, 4, 4, 32)))
    for name in ("avx512_bf16", "avx512", "avx2", "baseline"):
        assert not choices.CHOICES[name].planewise_others, name
