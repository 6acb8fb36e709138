"""What verl_traj did in a run, in words, from verl's logged metrics: ``python -m verl_traj.summary METRICS``.

Reads the ``file`` logger's JSONL (``trainer.logger=[console,file]``, ``VERL_FILE_LOGGER_PATH``) or a console log.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from verl_traj.core.rollout.length_bias import CENSORED, TAIL_MASS_LIMIT, pooled_bias
from verl_traj.metrics_log import load_metrics, moving_average, reward_key

__all__ = ["summarize"]


def _values(rows: list[dict], key: str) -> list[float]:
    return [float(r[key]) for r in rows if key in r]


def _total(rows: list[dict], key: str) -> float:
    return sum(_values(rows, key))


def _line_units(rows: list[dict]) -> str:
    trajs, groups = _total(rows, "traj_plan/trajectories"), _total(rows, "traj_plan/groups")
    split = _total(rows, "traj_plan/split_trajectories") + _total(rows, "traj_plan/split_groups")
    whole = "every one kept whole in one mini-batch" if split == 0 else f"{split:.0f} split (group_by=trajectory?)"
    return f"- {trajs:.0f} trajectories in {groups:.0f} GRPO groups: {whole}"


def _line_steps(rows: list[dict]) -> str:
    steps, expected = _values(rows, "actor/num_optimizer_steps"), _values(rows, "traj_plan/expected_optimizer_steps")
    if not steps:
        return "- optimizer steps: not logged"
    same = "as configured" if steps == expected else f"configured {sorted(set(expected))}"
    return f"- optimizer steps per training step: {sorted(set(int(s) for s in steps))} ({same}, whatever the turn count)"


def _line_merge(rows: list[dict]) -> Optional[str]:
    before, after = _total(rows, "traj_stepwise/tokens_before"), _total(rows, "traj_stepwise/tokens_after")
    if not before:
        return None
    calls, merged = _total(rows, "traj_stepwise/rows_before"), _total(rows, "traj_stepwise/rows_after")
    return (f"- step-wise rows: {calls:.0f} LLM calls became {merged:.0f} training rows by prefix merging; "
            f"{before:.0f} -> {after:.0f} training tokens ({before / max(after, 1):.2f}x fewer), loss tokens unchanged")


def _line_reward(rows: list[dict], window: int = 5) -> Optional[str]:
    """The reward's trend, readable through per-step noise: first third -> last third of the steps (means), and the
    moving average at the first and last step (per trajectory where logged, else verl's per-row mean)."""
    key = reward_key(rows)
    reward = _values(rows, key)
    if not reward:
        return None
    what = "mean reward per trajectory" if key == "traj_reward/mean" else "mean reward"
    if len(reward) < 3:
        return f"- {what}: {reward[0]:.3f} (step 1) -> {reward[-1]:.3f} (step {len(reward)})"
    n, third = len(reward), len(reward) // 3
    first, last = sum(reward[:third]) / third, sum(reward[-third:]) / third
    head, tail = ("step 1", f"step {n}") if third == 1 else (f"steps 1-{third}", f"steps {n - third + 1}-{n}")
    line = f"- {what}: {first:.3f} ({head}) -> {last:.3f} ({tail}), {last - first:+.3f}"
    if n >= 2 * window:  # a moving average needs room to move
        smooth = moving_average(reward, window)
        line += f"; moving average of {window} steps {smooth[window - 1]:.3f} -> {smooth[-1]:.3f}"
    return line


def _line_tool_calls(rows: list[dict]) -> Optional[str]:
    """Tool calls the model wrote malformed, as a share per step (the policy learning the call format)."""
    share = _values(rows, "traj_agent/malformed_tool_call_share")
    if not share:
        return None
    per_step = " ".join(f"{100 * v:.0f}%" for v in share)
    return (f"- malformed tool calls (the parser could not decode them, or no tool could take their arguments; counted, not logged as errors): "
            f"{100 * share[0]:.1f}% of calls at step 1 -> {100 * share[-1]:.1f}% at step {len(share)} "
            f"(per step: {per_step})")


def _let_go(steps: list[dict]) -> str:
    """Trajectories let go per cause over ``steps``, from each step's ``traj_bias/{cause}_share`` of all of it."""
    causes: dict[str, float] = {}
    for r in steps:
        everyone = float(r.get("traj_bias/trajectories_trained", 0.0)) + float(r.get("traj_bias/trajectories_cut", 0.0))
        for key, share in r.items():
            if key.startswith("traj_bias/") and key.endswith("_share") and not key.endswith("censored_share"):
                cause = key[len("traj_bias/"):-len("_share")]
                causes[cause] = causes.get(cause, 0.0) + float(share) * everyone
    return ", ".join(f"{cause} {n:.0f}" for cause, n in sorted(causes.items()) if round(n)) or "none"


def _bracket(pooled: dict, measure: str) -> str:
    """The pooled ratio of ``measure`` as read: ``between L and Ux`` (the bracket), ``Ux`` (its ends equal at three
    decimals, or nothing censored and no budget), ``at most Ux`` (flagged, no lower end)."""
    upper, lower = pooled[f"{measure}_mean_ratio"], pooled.get(f"{measure}_mean_ratio_lower")
    if lower is None:
        return f"at most {upper:.3f}x" if pooled["upper_bound_only"] else f"{upper:.3f}x"
    return f"{upper:.3f}x" if f"{lower:.3f}" == f"{upper:.3f}" else f"between {lower:.3f}x and {upper:.3f}x"


def _line_length_bias(rows: list[dict]) -> Optional[str]:
    """``traj_bias/*`` over the run, pooled exactly (:func:`~verl_traj.core.rollout.length_bias.pooled_bias`): the mean
    length of what trained against all that finished or was let go, as a bracket where trajectories were censored
    (the lower end puts them at the agent's budget, the upper is Kaplan-Meier's), "upper bound only" where any step
    flagged its upper end as a bound; how many were let go per cause, and the share censored per cause."""
    steps = [r for r in rows if "traj_bias/tokens_mean_ratio" in r and r.get("traj_bias/trajectories_trained")]
    if not steps:
        return None
    lows = min(float(r["traj_bias/tokens_mean_ratio"]) for r in steps)
    pooled = pooled_bias(steps)
    if not pooled:  # a log from before the per-step sums
        return (f"- length bias: per-step ratios only, not poolable (lowest step {lows:.3f}); let go: "
                f"{_let_go(steps)}")
    line = (f"- length bias over {pooled['steps']:.0f} steps, pooled: what trained had {_bracket(pooled, 'tokens')} "
            f"the mean length (tokens) of all that finished or was let go, {_bracket(pooled, 'turns')} in turns (1.0: "
            f"none; lowest step {lows:.3f}); {pooled['trajectories_trained']:.0f} trajectories trained, let go: "
            f"{_let_go(steps)}")
    if pooled["censored_share"] > 0:
        causes = ", ".join(f"{c} {100 * pooled[f'{c}_censored_share']:.1f}%" for c in sorted(CENSORED))
        line += f"; censored (stopped early): {100 * pooled['censored_share']:.1f}% ({causes})"
    if pooled["upper_bound_only"]:
        line += (f"; upper bound only in {pooled['upper_bound_only_steps']:.0f} of {pooled['steps']:.0f} steps (over "
                 f"{100 * TAIL_MASS_LIMIT:.0f}% of the length distribution past the longest finished trajectory, or "
                 "censored with no token budget known): the truth likely well below it")
    return line


def _line_offpolicy(rows: list[dict]) -> Optional[str]:
    """``traj_offpolicy/*`` over the run (``traj.stale_groups=correct``): the oldest trained token's lag against the
    cap's evidence, the weights' health at their worst step (the gate's two statistics and the untruncated ESS), the
    steps in fallback and the groups past the cap."""
    lags = _values(rows, "traj_offpolicy/lag_max")
    if not lags:
        return None
    steps = _values(rows, "traj_offpolicy/fallback_active")

    def worst(key: str, pick=min) -> str:
        values = _values(rows, key)
        return f"{pick(values):.3f}" if values else "n/a"
    past_cap = _total(rows, "traj_offpolicy/groups_past_cap_dropped_total")
    oldest = f"{max(lags):.0f} version{'' if max(lags) == 1 else 's'}"
    return (f"- off-policy (correct): oldest trained token {oldest} old (p99 at most "
            f"{max(_values(rows, 'traj_offpolicy/lag_p99') or [0.0]):.0f}); worst step: ESS of the truncated weights "
            f"{worst('traj_offpolicy/ess_truncated')}, mean squared log-ratio "
            f"{worst('traj_offpolicy/log_ratio_m2', max)}, untruncated ESS {worst('traj_offpolicy/ess')}; fallback "
            f"active {sum(steps):.0f} of {len(steps)} steps; {past_cap:.0f} groups past traj.max_lag dropped, {_total(rows, 'traj_staleness/groups_deferred_total'):.0f} waited for, "
            f"{_total(rows, 'traj_staleness/groups_corrected_total'):.0f} trained corrected")


def summarize(rows: list[dict], metrics_path: str = "", plot_path: str = "") -> str:
    """A short human-readable account of the run (see the module docstring)."""
    if not rows:
        return "no metrics logged (use trainer.logger=[console,file])"
    lines = [f"verl_traj summary: {len(rows)} training steps"]
    lines += [line for line in (_line_reward(rows), _line_tool_calls(rows)) if line]
    lines += [_line_units(rows), _line_steps(rows)]
    lines += [line for line in (_line_merge(rows), _line_length_bias(rows), _line_offpolicy(rows)) if line]
    worst = max(_values(rows, "traj_plan/balance_ratio_worst") or [float("nan")])
    lines.append(f"- padding rows added: {_total(rows, 'traj_plan/padding_rows'):.0f}; DP balance (slowest rank / "
                 f"lower bound, worst mini-batch): {worst:.3f}")
    planned, run = _total(rows, "traj_plan/micro_batches"), _total(rows, "actor/micro_batches_per_epoch")
    if planned:
        lines.append(f"- micro-batches: {run:.0f} run by the workers, {planned:.0f} planned")
    prepass = _values(rows, "actor/prepass_micro_batches_per_epoch")
    if prepass:  # GSPO at traj.ratio_scope=trajectory: extra no-grad forwards, not part of the plan
        lines.append(f"- GSPO trajectory pre-pass: {sum(prepass):.0f} extra no-grad micro-batches per epoch over "
                     f"{len(prepass)} steps; {_total(rows, 'actor/prepass_skipped_steps'):.0f} optimizer steps "
                     "skipped it (on-policy, deterministic forward)")
    if metrics_path:
        lines.append(f"- metrics: {metrics_path}" + (f"; plot: {plot_path}" if plot_path else ""))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("metrics")
    args = ap.parse_args(argv)
    print(summarize(load_metrics(args.metrics), args.metrics))
    return 0


if __name__ == "__main__":
    sys.exit(main())
