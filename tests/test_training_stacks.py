"""Training stacks on 4 gloo ranks (a 2 x 2 dp x cp DeviceMesh): FSDP2 over
the flattened mesh and DDP over every rank equal the one-process run; FSDP2
or DDP over dp alone (gradients never summed over cp) is caught by
check_cp_gradients, whose other cases are checked on 2 ranks;
build_kcp_context takes meshes."""

from __future__ import annotations

from dp_cp_cases import (check_gradient_check_cases, check_group_forms, check_mistake_is_caught, check_recipes,
                         one_process_run)
from spawn import spawn_ranks


def test_fsdp2_and_ddp_over_dp_x_cp_equal_one_process():
    spawn_ranks(4, check_recipes, one_process_run())


def test_fsdp2_or_ddp_over_dp_alone_is_caught():
    spawn_ranks(4, check_mistake_is_caught)


def test_gradient_check_cases():
    spawn_ranks(2, check_gradient_check_cases)


def test_group_forms():
    spawn_ranks(4, check_group_forms)
