"""nnU-Net v2's 3d_fullres rules for a whole case: target spacing, per-axis kernels and strides, the batch cap.

Every expected value below was produced by nnU-Net v2.8.1's own functions on the same inputs, in a
benchmark-only venv (``python3 -m venv /work/nnunet-venv && /work/nnunet-venv/bin/pip install
nnunetv2==2.8.1``), never by bigmem's implementation:

- kernels, strides, padded shape, divisors: ``network_topology.get_pool_and_conv_props(spacing,
  shape, 4, 999999)`` (the arguments ``get_plans_for_configuration`` passes);
- target spacing: ``ExperimentPlanner.determine_fullres_target_spacing`` called on a stand-in
  ``self`` (``SimpleNamespace(overwrite_target_spacing=None, anisotropy_threshold=3,
  dataset_fingerprint={"spacings": ..., "shapes_after_crop": ...})``); median shapes from
  ``np.median([compute_new_shape(shape, spacing, target) ...], 0)`` as ``plan_experiment`` takes it;
- batch cap: ``ExperimentPlanner(990).get_plans_for_configuration((1., 1., 1.), (32, 32, 32), "x",
  n_voxels, {})["batch_size"]`` on an empty stand-in dataset, whose 32^3 patch leaves the memory
  batch far above the cap; the same with ``nnUNetPlannerResEncM`` (``max_dataset_covered = 1``).

The same comparison over 9,000 random inputs (spacings, fractional medians, min_edge and max_pool
limits, the anisotropic and bounded branches) matched exactly.
"""

from __future__ import annotations

import doctest

import pytest

from bigmem.config import topology
from bigmem.config.topology import (Topology, batch_cap, dataset_topology, median_shape, pool_and_kernels,
                                    resampled_shape, target_spacing)


def test_the_docstring_examples_hold():
    failures, tried = doctest.testmod(topology)
    assert tried > 0
    assert failures == 0


# ---- pool_and_kernels: get_pool_and_conv_props ----------------------------------------------------------


@pytest.fixture(scope="module")
def brain() -> Topology:
    return pool_and_kernels((1.0, 1.0, 1.0), (160, 192, 160))


def test_isotropic_brain_has_six_stages(brain):
    assert brain.stages == 6


def test_isotropic_brain_convolves_3x3x3_at_every_stage(brain):
    assert brain.kernel_sizes == ((3, 3, 3),) * 6


def test_isotropic_brain_halves_every_axis_below_stage_0(brain):
    assert brain.strides == ((1, 1, 1),) + ((2, 2, 2),) * 5


def test_isotropic_brain_needs_multiples_of_32(brain):
    assert brain.divisors == (32, 32, 32)


def test_isotropic_brain_needs_no_padding(brain):
    assert brain.padded_shape == (160, 192, 160)


def test_features_double_up_to_320(brain):
    assert brain.features == (32, 64, 128, 256, 320, 320)


@pytest.fixture(scope="module")
def kits() -> Topology:
    return pool_and_kernels((3.0, 0.8, 0.8), (100, 256, 256))


def test_kits_like_first_kernel_is_planar(kits):
    assert kits.kernel_sizes[0] == (1, 3, 3)


def test_kits_like_second_kernel_is_3d(kits):
    assert kits.kernel_sizes[1] == (3, 3, 3)


def test_kits_like_stage_1_halves_only_the_fine_axes(kits):
    assert kits.strides[1] == (1, 2, 2)


def test_kits_like_stages_2_to_5_halve_every_axis(kits):
    assert kits.strides[2:6] == ((2, 2, 2),) * 4


def test_kits_like_last_stage_halves_only_the_fine_axes(kits):
    assert kits.strides[6] == (1, 2, 2)


def test_kits_like_has_seven_stages(kits):
    assert kits.stages == 7


def test_kits_like_divisors(kits):
    assert kits.divisors == (16, 64, 64)


def test_kits_like_pads_100_slices_to_112(kits):
    assert kits.padded_shape == (112, 256, 256)


def test_the_axis_order_is_the_callers():
    reversed_axes = pool_and_kernels((0.8, 0.8, 3.0), (256, 256, 100))
    assert reversed_axes.kernel_sizes[0] == (3, 3, 1)
    assert reversed_axes.strides[6] == (2, 2, 1)
    assert reversed_axes.padded_shape == (256, 256, 112)


@pytest.fixture(scope="module")
def prostate() -> Topology:
    return pool_and_kernels((3.6, 0.6, 0.6), (20, 320, 320))


def test_prostate_like_strides(prostate):
    assert prostate.strides == ((1, 1, 1), (1, 2, 2), (1, 2, 2), (2, 2, 2), (2, 2, 2), (1, 2, 2), (1, 2, 2))


def test_prostate_like_kernels(prostate):
    assert prostate.kernel_sizes == ((1, 3, 3), (1, 3, 3), (3, 3, 3), (3, 3, 3), (3, 3, 3), (3, 3, 3), (3, 3, 3))


def test_prostate_like_divisors(prostate):
    assert prostate.divisors == (4, 64, 64)


def test_a_lone_axis_is_halved_while_at_least_three_min_edges():
    odd = pool_and_kernels((1.0, 1.0, 1.0), (77, 33, 129))
    assert odd.strides[-1] == (2, 1, 2)
    assert odd.padded_shape == (80, 40, 144)
    assert odd.divisors == (16, 8, 16)


def test_a_median_between_two_sizes_is_planned_as_nnunet_does():
    half = pool_and_kernels((2.0, 0.7, 0.7), (76.5, 200, 190.5))
    assert half.strides == ((1, 1, 1), (1, 2, 2), (2, 2, 2), (2, 2, 2), (2, 2, 2), (2, 2, 2))
    assert half.padded_shape == (80, 224, 192)


def test_a_shape_below_two_min_edges_is_one_stage():
    tiny = pool_and_kernels((1.0, 1.0, 1.0), (7, 7, 7))
    assert tiny.strides == ((1, 1, 1),)
    assert tiny.kernel_sizes == ((3, 3, 3),)
    assert tiny.to_model_table()["depth"] == 0


def test_max_pool_stops_the_descent():
    limited = pool_and_kernels((1.0, 1.0, 1.0), (160, 192, 160), max_pool=3)
    assert limited.stages == 4
    assert limited.divisors == (8, 8, 8)


def test_the_model_table_uses_the_schema_field_names(kits):
    table = kits.to_model_table()
    assert table == {"depth": 6, "base_filters": 32, "max_filters": 320,
                     "kernel_sizes": [[1, 3, 3]] + [[3, 3, 3]] * 6,
                     "strides": [[1, 1, 1], [1, 2, 2], [2, 2, 2], [2, 2, 2], [2, 2, 2], [2, 2, 2], [1, 2, 2]]}


def test_pools_per_axis(kits):
    assert kits.pools_per_axis == (4, 6, 6)


# ---- target_spacing: determine_fullres_target_spacing ----------------------------------------------------


def test_isotropic_target_is_the_median():
    assert target_spacing([(1.0, 1.0, 1.0)] * 3 + [(1.2, 1.0, 0.9)], [(160, 192, 160)] * 4) == (1.0, 1.0, 1.0)


def test_an_even_count_takes_the_mean_of_the_middle_two():
    assert target_spacing([(1.0, 0.8, 0.8), (2.0, 0.7, 0.7)], [(100, 200, 200), (60, 220, 220)]) == (1.5, 0.75, 0.75)


def test_few_thick_slices_take_the_10th_percentile():
    spacings = [(5.0, 0.7, 0.7), (4.0, 0.7, 0.7), (3.0, 0.7, 0.7), (5.0, 0.7, 0.7), (6.0, 0.7, 0.7)]
    shapes = [(20, 320, 320), (25, 320, 320), (30, 320, 320), (20, 320, 320), (18, 320, 320)]
    assert target_spacing(spacings, shapes) == (3.4, 0.7, 0.7)


def test_the_coarse_axis_may_be_any():
    spacings = [(0.6, 0.6, 3.6), (0.6, 0.6, 4.0), (0.62, 0.62, 3.0), (0.6, 0.6, 3.6)]
    shapes = [(320, 320, 20), (320, 320, 18), (300, 300, 24), (320, 320, 20)]
    assert target_spacing(spacings, shapes) == (0.6, 0.6, 3.18)


def test_many_thick_slices_keep_the_median():
    spacings = [(3.0, 0.8, 0.8), (3.5, 0.8, 0.8), (2.5, 0.8, 0.8)]
    shapes = [(120, 256, 256), (100, 256, 256), (140, 256, 256)]
    assert target_spacing(spacings, shapes) == (3.0, 0.8, 0.8)


def test_coarse_spacing_without_few_voxels_keeps_the_median():
    spacings = [(4.0, 1.0, 1.0), (4.0, 1.0, 1.0), (2.0, 1.0, 1.0)]
    assert target_spacing(spacings, [(100, 200, 200), (100, 200, 200), (200, 200, 200)]) == (4.0, 1.0, 1.0)


def test_exactly_three_times_coarser_is_not_anisotropic():
    assert target_spacing([(3.0, 1.0, 1.0)] * 2, [(10, 100, 100)] * 2) == (3.0, 1.0, 1.0)


def test_a_percentile_finer_than_the_other_axes_is_bounded_by_them():
    spacings = [(5.0, 1.5, 1.5)] * 3 + [(1.0, 1.5, 1.5)] * 2
    shapes = [(10, 200, 200)] * 3 + [(50, 200, 200)] * 2
    assert target_spacing(spacings, shapes) == (1.50001, 1.5, 1.5)


# ---- median_shape: plan_experiment's new_median_shape ----------------------------------------------------


def test_resampled_shape_rounds_each_axis():
    assert resampled_shape((100, 256, 256), (3.0, 0.78, 0.78), (3.0, 0.8, 0.8)) == (100, 250, 250)


def test_median_shape_of_an_even_count_may_be_half_a_voxel():
    assert median_shape([(1.0, 1.0, 1.0)] * 2, [(100, 90, 80), (101, 90, 80)], (1.0, 1.0, 1.0)) == (100.5, 90.0,
                                                                                                    80.0)


def test_dataset_topology_plans_the_median_case():
    spacings = [(0.6, 0.6, 3.6)] * 3
    shapes = [(320, 320, 20)] * 3
    assert dataset_topology(spacings, shapes).kernel_sizes[:2] == ((3, 3, 1), (3, 3, 1))


# ---- batch_cap: get_plans_for_configuration's 5% rule ----------------------------------------------------


@pytest.mark.parametrize("patches, expected", [(10, 2), (50, 2), (60, 3), (70, 4), (90, 4), (1000, 50)])
def test_batch_cap_rounds_half_to_even_with_a_floor_of_two(patches, expected):
    assert batch_cap(patches * 32 ** 3, 32 ** 3) == expected


def test_batch_cap_of_a_padded_patch():
    assert batch_cap(50 * 30 ** 3, 32 ** 3) == 2  # median 30^3 -> patch 32^3: nnU-Net's 2


def test_resenc_planners_cover_the_whole_dataset():
    assert batch_cap(10 * 32 ** 3, 32 ** 3, max_dataset_covered=1) == 10
