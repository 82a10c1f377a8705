"""Outcome lab: does SetGRPO train a better policy than GRPO under a noisy rubric grader? (docs/outcome.md)

A simulated RL run with exact per-response gradients, driven by the library's own ``calibrate``,
``setgrpo_coefficients`` and ``OnlineRiskMonitor``:

* **Policy**: a softmax over ``C`` candidate responses per prompt with shared linear features,
  ``pi(c | p) = softmax_c(phi(p, c) . theta)``, ``theta`` in R^D (D = 256). Every prompt's gradient moves the same
  parameters, so the groups of a step interact, as an LLM's do. The per-response gradient of ``log pi`` is
  ``phi(p, c) - E_pi[phi(p, .)]`` exactly, and the Gram matrix of a group is formed from it (no sketch).
* **Rubrics**: every prompt has 3-6 criteria with points 1-6; whether a candidate meets a criterion is drawn once
  per world from a latent quality that a shared direction of the features predicts. The truth score is the rubric
  score of those verdicts (docs/algorithm.md#0-notation).
* **Graders**: ``flip``, the ``NoisyGrader`` rule (docs/validation.md#noisy-grader): every scoring flips every verdict
  independently with probability ``flip``, drawn fresh per call; ``length``, a systematic error: the flip rate of
  a candidate is ``2 flip l`` with ``l`` in [0, 1] its length, so long responses are scored worse, every time;
  ``misread``, heavy-tailed errors: with probability ``flip`` a scoring misreads the whole response and every one of
  its verdicts flips together (each verdict still flips with probability ``flip``, as under ``flip``, but the errors
  of a response's criteria come together, as when a judge grades the wrong answer); ``uneven``, noise that differs
  between prompts: prompt ``p`` has its own flip rate ``min(0.5, 4 flip a_p^3)`` with ``a_p`` uniform in [0, 1] per
  world (mean ``flip`` before the cap; most rubrics graded almost cleanly, a few at up to pure noise, as a judge
  that cannot grade some rubrics), drawn fresh per verdict and call.
* **Common random numbers**: per seed, every arm sees the same prompts, the same sampling uniforms and the same
  flip uniforms at every step; only what the arms do with them differs.
* **Training**: the update direction is ``u = 1 / (G K) sum_g sum_i a_gi g_gi`` (the PPO-clip gradient at ratio 1,
  token-mean over one-token responses). ``--optimizer sgd`` (the default) takes ``theta += lr u``; ``--optimizer
  adam`` takes a step of ``torch.optim.AdamW`` with verl's actor defaults (betas 0.9 and 0.999, weight decay 0.01; no
  gradient clipping), under which a constant scale of every coefficient no longer changes the step. One learning
  rate per optimizer, tuned for GRPO, for every arm.
* **Measures**: the gain in expected truth reward ``E_p E_{c ~ pi} r*(p, c)`` over the start, at equal steps and at
  equal training grader calls, with 95 % t-bands over seeds and paired bands against ``grpo`` and ``grpo_mean2``;
  the accepted share per step; the cosine of each step's update with the truth-GRPO update on the same samples.

The SetGRPO arms are calibrated once per (grader, K) on ``--calib-groups`` groups at the initial policy (their
grader calls are reported apart from training's). The world (features, rubrics, verdicts) is one fixed draw;
seeds vary the training streams.

    python benchmarks/outcome_lab.py --quick                 # < 10 min on 2 cores
    python benchmarks/outcome_lab.py --json lab.json         # the full table
    python benchmarks/outcome_lab.py --shards validation/paper   # the real-geometry instrument

Its last line is ``outcome lab: ...``, the default arm's paired gain over ``grpo_mean2`` and ``grpo``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from scipy import stats

from setgrpo_verl.core import (
    calibrate,
    CalibrationRecord,
    CalibrationSettings,
    grpo_coefficients,
    OnlineRiskMonitor,
    reliability_coefficients,
    reliability_weights,
    setgrpo_coefficients,
)
from setgrpo_verl.core.ggsr import projections
from setgrpo_verl.core.grpo import degenerate_groups
from setgrpo_verl.core.jrsc import CoefficientSets, conformal_radius, set_shape
from setgrpo_verl.core.reliability import weights_from_noise

# One thread: the lab's tensors are small (thread start-up and spin-waiting cost more than they save on a busy
# machine), and one summation order gives the same numbers on every host.
torch.set_num_threads(1)

PAPER_LEVELS = {"alpha": 0.05, "beta": 0.08, "delta": 0.05}
# The product's default (integration/config.py SetGRPOConfig); tests/test_outcome_lab.py checks the two agree.
PRODUCT_DEFAULT = {"variant": "paper", **PAPER_LEVELS}
LOOSE_LEVELS = {"alpha": 0.2, "beta": 0.3, "delta": 0.1}
WIDE_LEVELS = {"alpha": 0.5, "beta": 0.5, "delta": 0.2}
# Tuned for GRPO at flip 0.1, K 4 (``--tune-lr``): the best final gain over TUNE_GRID's learning rates.
LR = 30.0
ADAM_LR = 0.3
TUNE_GRID = {"sgd": (0.3, 1, 3, 10, 30), "adam": (0.03, 0.1, 0.3, 1, 3)}
# verl's actor optimizer (actor.optim): AdamW with these betas and weight decay
ADAM_BETAS, ADAM_WEIGHT_DECAY = (0.9, 0.999), 0.01
CURVE_EVERY = 5  # the mean truth-reward curve in the --json rows, every 5th step from 0
ONLINE_EVERY, ONLINE_WINDOW_STEPS = 10, 32  # refit every 10 steps on the last 32 x G groups


# --------------------------------------------------------------------------------------------------- the world
@dataclass(frozen=True)
class World:
    """One fixed draw of prompts, candidates and rubrics (float64 tensors).

    Attributes:
        phi: ``[P, C, D]`` candidate features.
        verdicts: ``[P, C, J]`` 0/1 truth verdicts (J = 6; criteria beyond a prompt's count are masked by zero points).
        points: ``[P, J]`` criterion points (0 where a prompt has fewer criteria).
        truth: ``[P, C]`` truth rubric scores in [0, 1].
        length: ``[P, C]`` response lengths in [0, 1] (the systematic grader's flip rate grows with them).
        ambiguity: ``[P]`` per-prompt values in [0, 1] (the ``uneven`` grader's flip rate grows with them).
    """

    phi: torch.Tensor
    verdicts: torch.Tensor
    points: torch.Tensor
    truth: torch.Tensor
    length: torch.Tensor
    ambiguity: torch.Tensor


def make_world(seed: int = 0, prompts: int = 512, candidates: int = 16, dim: int = 256) -> World:
    """A world whose truth a shared feature direction predicts (so training on any prompt helps the others)."""
    g = torch.Generator().manual_seed(seed)
    phi = torch.randn(prompts, candidates, dim, generator=g, dtype=torch.float64)
    direction = torch.randn(dim, generator=g, dtype=torch.float64)
    quality = phi @ direction / math.sqrt(dim) + 1.5 * torch.randn(prompts, candidates, generator=g, dtype=torch.float64)
    n_crit = torch.randint(3, 7, (prompts,), generator=g)
    points = torch.randint(1, 7, (prompts, 6), generator=g).double() * (torch.arange(6)[None] < n_crit[:, None])
    difficulty = torch.randn(prompts, 1, 6, generator=g, dtype=torch.float64)
    p_met = torch.sigmoid(1.5 * quality[..., None] - difficulty)
    verdicts = (torch.rand(prompts, candidates, 6, generator=g, dtype=torch.float64) < p_met).double()
    truth = (verdicts * points[:, None]).sum(-1) / points.sum(-1)[:, None]
    length = torch.rand(prompts, candidates, generator=g, dtype=torch.float64)
    ambiguity = torch.rand(prompts, generator=g, dtype=torch.float64)  # drawn last: the fields above are unchanged
    return World(phi=phi / math.sqrt(dim) * 2.0, verdicts=verdicts, points=points, truth=truth, length=length,
                 ambiguity=ambiguity)


def expected_truth(world: World, theta: torch.Tensor) -> torch.Tensor:
    """``[S]`` expected truth reward of the policies ``theta [S, D]`` over all prompts."""
    pi = torch.softmax(torch.einsum("pcd,sd->spc", world.phi, theta), -1)
    return (pi * world.truth[None]).sum(-1).mean(-1)


@dataclass
class Batch:
    """One step's samples of S streams x G groups x K responses, at the policies that drew them."""

    prompt: torch.Tensor   # [S, G] long
    cand: torch.Tensor     # [S, G, K] long
    grad: torch.Tensor     # [S, G, K, D] per-response gradients of log pi
    gram: torch.Tensor     # [S, G, K, K]
    truth: torch.Tensor    # [S, G, K]
    scores: list = field(default_factory=list)  # scorings, each [S, G, K]
    noise_var: torch.Tensor | None = None  # [S, G, K] the variance of one scoring's error, from the grader's rates
    observed: list = field(default_factory=list)  # each scoring's 0/1 verdicts as graded, [S, G, K, J]
    points: torch.Tensor | None = None  # [S, G, 1, J] criterion points (0 beyond a prompt's criteria)


def rubric_scores(verdicts: torch.Tensor, points: torch.Tensor, flipped: torch.Tensor) -> torch.Tensor:
    """Grading's ``rubric_score`` of every response after flipping the verdicts where ``flipped``
    (docs/algorithm.md#0-notation): met points over the positive points of the criteria with a verdict (their
    absolute negative points for an all-negative rubric). ``verdicts`` ``[..., J]`` (1 met, 0 unmet, -1 no verdict
    or no criterion J), ``points`` and ``flipped`` broadcast to it; returns ``[...]`` float64."""
    parsed = verdicts >= 0
    positive = torch.where(parsed, points.clamp_min(0), 0).sum(-1)
    norm = torch.where(positive > 0, positive, torch.where(parsed, (-points).clamp_min(0), 0).sum(-1))
    met = torch.where(flipped & parsed, 1 - verdicts, verdicts).clamp_min(0)
    return (met * points).sum(-1) / norm


def draw(world: World, theta: torch.Tensor, prompt: torch.Tensor, uniform: torch.Tensor, flips: torch.Tensor,
         grader: "Grader") -> Batch:
    """Sample with the inverse CDF of ``pi(. | p)`` at ``uniform [S, G, K]``, and score with ``flips [n, S, G, K, J]``
    (one scoring per leading index: which verdicts flip is ``grader.flipped`` of the uniforms)."""
    phi = world.phi[prompt]                                         # [S, G, C, D]
    pi = torch.softmax(torch.einsum("sgcd,sd->sgc", phi, theta), -1)
    cdf = pi.cumsum(-1)
    cand = torch.searchsorted(cdf.contiguous(), uniform.contiguous()).clamp_max(pi.shape[-1] - 1)
    mean_phi = torch.einsum("sgc,sgcd->sgd", pi, phi)
    grad = torch.gather(phi, 2, cand[..., None].expand(*cand.shape, phi.shape[-1])) - mean_phi[:, :, None]
    p_idx = prompt[..., None].expand_as(cand)
    verdicts = world.verdicts[p_idx, cand]                          # [S, G, K, J]
    points = world.points[prompt][:, :, None]                       # [S, G, 1, J]
    length = world.length[p_idx, cand]                              # [S, G, K]
    ambiguity = world.ambiguity[p_idx]                              # [S, G, K]
    flipped = [grader.flipped(u, length, ambiguity) for u in flips]
    return Batch(prompt=prompt, cand=cand, grad=grad, gram=grad @ grad.transpose(-1, -2),
                 truth=world.truth[p_idx, cand], scores=[rubric_scores(verdicts, points, f) for f in flipped],
                 noise_var=grader.score_noise_var(verdicts, points, length, ambiguity),
                 observed=[torch.where(f, 1 - verdicts, verdicts) for f in flipped], points=points)


@dataclass(frozen=True)
class Grader:
    """A simulated grader: ``rate`` maps response lengths and their prompts' ambiguities (both ``[...]``, in [0, 1])
    to each verdict's flip probability; ``whole_response`` flips all of a response's verdicts together, on its first
    criterion's uniform."""

    rate: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    whole_response: bool = False

    def flipped(self, uniform: torch.Tensor, length: torch.Tensor, ambiguity: torch.Tensor) -> torch.Tensor:
        """``[..., J]`` bool: the verdicts one scoring flips, from its uniforms ``[..., J]``, the responses' lengths
        ``[...]`` and their prompts' ambiguities ``[...]``."""
        rate = self.rate(length, ambiguity)[..., None]
        return (uniform[..., :1] < rate).expand_as(uniform) if self.whole_response else uniform < rate

    def score_noise_var(self, verdicts: torch.Tensor, points: torch.Tensor, length: torch.Tensor,
                        ambiguity: torch.Tensor) -> torch.Tensor:
        """``[...]`` the exact variance of one scoring's rubric-score error, for 0/1 ``verdicts [..., J]`` and
        non-negative ``points`` (broadcast to them): a flip of criterion ``j`` moves the score by
        ``(1 - 2 v_j) p_j / N`` (``N`` the points' sum), so independent flips at rate ``q`` give
        ``q (1 - q) sum_j (p_j / N)^2`` and a whole-response flip gives ``q (1 - q) (sum_j (1 - 2 v_j) p_j / N)^2``.
        Raises ``ValueError`` for a verdict other than 0/1 or a negative point (``rubric_scores``' other cases)."""
        if bool(((verdicts != 0) & (verdicts != 1)).any()) or bool((points < 0).any()):
            raise ValueError("score_noise_var covers 0/1 verdicts and non-negative points, as the lab's world has")
        q = self.rate(length, ambiguity)
        step = (1 - 2 * verdicts) * points / points.sum(-1, keepdim=True)
        spread = step.sum(-1).square() if self.whole_response else step.square().sum(-1)
        return q * (1 - q) * spread


#: The lab's graders (see the module docstring).
GRADERS = ("flip", "length", "misread", "uneven")


def make_grader(grader: str, flip: float) -> Grader:
    """A grader of :data:`GRADERS` at ``flip``: ``flip`` per verdict everywhere (``flip``, and ``misread`` with whole
    responses), ``2 flip l`` with length ``l`` (``length``, capped below 1), or ``4 flip a^3`` with the prompt's
    ambiguity ``a`` (``uneven``, capped at 0.5, where a score no longer depends on the truth). Raises ``ValueError``
    for another name."""
    if grader in ("flip", "misread"):
        return Grader(lambda length, ambiguity: torch.full_like(length, flip), whole_response=grader == "misread")
    if grader == "length":
        return Grader(lambda length, ambiguity: (2.0 * flip * length).clamp_max(0.95))
    if grader == "uneven":
        return Grader(lambda length, ambiguity: (4.0 * flip * ambiguity.pow(3)).clamp_max(0.5))
    raise ValueError(f"unknown grader {grader!r}: use one of {', '.join(GRADERS)}")


# --------------------------------------------------------------------------------------------------- the arms
def range_advantages(center: torch.Tensor, half_width: torch.Tensor) -> torch.Tensor:
    """Range-GRPO's pairwise interval advantages ``[..., K]`` of reward ranges ``center +- half_width`` (``[..., K]``).

    ``A_i = (1/K) sum_j kappa_ij (m_i - m_j)`` with ``kappa_ij = d^2 / (d^2 + (h_i + h_j)^2)``, ``d = m_i - m_j``:
    a pair whose midpoints differ by less than their combined uncertainty contributes less, and a pair of wider
    intervals less than a pair of narrow ones. With every ``h = 0``, ``kappa = 1`` and ``A`` is Dr.GRPO's
    ``m_i - mean(m)``. (the source text of Range-GRPO this project has keeps no equations; this is the lab's reading
    of its stated properties: pairwise, width-downweighted, Dr.GRPO at collapse.)
    """
    d = center[..., :, None] - center[..., None, :]
    h = half_width[..., :, None] + half_width[..., None, :]
    kappa = torch.where(d == 0, torch.zeros_like(d), d.square() / (d.square() + h.square()).clamp_min(1e-300))
    return (kappa * d).mean(-1)


def flip_rate_from_pairs(o1: torch.Tensor, o2: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """The verdict flip rate ``q`` that two independent scorings' disagreement implies: under symmetric flips at
    rate ``q``, a verdict pair disagrees with probability ``d = 2 q (1 - q)``, so ``q = (1 - sqrt(1 - 2 d)) / 2``
    (0.5 where ``d >= 0.5``). ``o1``, ``o2`` ``[S, ..., J]`` 0/1 verdicts, ``live`` broadcast to them (the
    criteria that exist); returns ``[S]`` float64, pooled over everything but the first dimension."""
    live = live.expand_as(o1)
    dims = tuple(range(1, o1.dim()))
    d = ((o1 != o2) & live).double().sum(dims) / live.double().sum(dims).clamp_min(1)
    return (1 - (1 - 2 * d).clamp_min(0).sqrt()) / 2


def verdict_posterior_scores(observed: list, points: torch.Tensor, q: torch.Tensor, iterations: int = 20):
    """Rubric scores ``[S, G, K]`` of the verdicts' posterior means, under symmetric flips at rate ``q`` (``[S]``)
    and a truth rate per (group, criterion) fitted to the group's own verdicts.

    Model: response ``i``'s truth verdict on criterion ``j`` of group ``g`` is Bernoulli(``pi_gj``), independently
    over ``i``; every scoring flips it independently with probability ``q``. ``pi_gj`` is the MAP under a
    Beta(2, 2) prior (EM: ``pi <- (sum_i P(v_i = 1 | o_i) + 1) / (K + 2)``), and the score is
    ``sum_j p_j P(v_ij = 1 | o_ij) / sum_j p_j``. A criterion that nearly every response of the group meets (or
    fails) pulls a disagreeing pair of scorings toward the group's rate instead of 0.5, so that criterion adds
    little noise to the group's contrast. At ``q = 0`` the posterior is the verdict itself (GRPO on the scores).
    ``observed``: one ``[S, G, K, J]`` 0/1 tensor per scoring; ``points`` ``[S, G, 1, J]``, non-negative."""
    n1 = sum(observed)                                              # [S, G, K, J] scorings that say "met"
    n = len(observed)
    qq = q.clamp(1e-9, 0.5).reshape(-1, *([1] * (n1.dim() - 1)))
    log_ratio = (2 * n1 - n) * (torch.log1p(-qq) - torch.log(qq))     # log L(met) - log L(unmet)
    pi = torch.full(n1.shape[:2] + n1.shape[3:], 0.5, dtype=torch.float64)[:, :, None]  # [S, G, 1, J]
    for _ in range(iterations):
        post = torch.sigmoid(log_ratio + torch.logit(pi))
        pi = (post.sum(2, keepdim=True) + 1) / (n1.shape[2] + 2)
    post = torch.sigmoid(log_ratio + torch.logit(pi))
    return (post * points).sum(-1) / points.sum(-1)


@dataclass(frozen=True)
class Arm:
    """A training arm: how many scorings a training step pays for per response (1.25 where a quarter of the groups
    is scored twice), and its coefficients from a batch.

    ``coefficients(batch, state) -> (a [S, G, K], accepted [S, G] bool or None)``; ``state`` holds the arm's
    calibration (records, widths) and running monitors; ``record`` is the key of the calibration it uses in
    ``state`` (None for an arm without one).
    """

    name: str
    scorings: float
    coefficients: Callable
    record: str | None = None


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, *x.shape[2:])


def _setgrpo(point: torch.Tensor, gram: torch.Tensor, record: CalibrationRecord):
    s, g, k = point.shape
    res = setgrpo_coefficients(_flat(point), _flat(gram), record)
    return res, res.coefficients.reshape(s, g, k), res.accepted.reshape(s, g)


def _weighted_grpo(point: torch.Tensor, noise: torch.Tensor):
    """GRPO coefficients of ``point [S, G, K]``, each group scaled by core's ``weights_from_noise`` with its noise
    variance ``noise [S, G]``; returns ``(a [S, G, K], trained [S, G] bool)``, the reliability arms' output."""
    w = weights_from_noise(_flat(point), noise.flatten()).reshape(noise.shape)
    return grpo_coefficients(_flat(point)).reshape(point.shape) * w[..., None], w > 0


def soft_weights(point: torch.Tensor, gram: torch.Tensor, record: CalibrationRecord) -> torch.Tensor:
    """``[G]`` certified weights ``w = clip(M_full(a_hat), 0, 1)`` of the GRPO coefficients ``a_hat = T(point)``.

    ``M_full(a_hat) = min_{c in C} <u(c), u(a_hat)> / ||u(a_hat)||^2`` (docs/algorithm.md#32-projections) is the
    share of the group's GRPO update that every coefficient vector of its JRSC set agrees with. ``w = 1`` when the
    set collapses (``Q_alpha = 0``: plain GRPO) and ``w = 0`` when some plausible coefficients reverse the update;
    a group whose reference coefficients lie in its set (probability >= 1 - alpha) cannot reverse a trained update,
    so a trained group reverses with probability <= alpha (marginally, under exchangeability).
    """
    w = torch.zeros(point.shape[0], dtype=torch.float64)
    live = ~degenerate_groups(point, record.degenerate_rtol)
    if not bool(live.any()):
        return w
    p = point[live]
    st = record.settings
    center = grpo_coefficients(p, st.norm_by_std, st.eps)
    root, pinv = set_shape(p, rho=st.rho, norm_by_std=st.norm_by_std, eps=st.eps)
    sets = CoefficientSets(center=center, root=root, pinv=pinv, radius=record.q_alpha)
    m_full, _ = projections(center, sets, gram[live])
    w[live] = torch.nan_to_num(m_full, neginf=0.0).clamp(0.0, 1.0)
    return w


def make_arms() -> dict[str, Arm]:
    """The lab's arms (validation/outcome_lab/README.md#arms)."""

    def grpo(b, st):
        return grpo_coefficients(_flat(b.scores[0])).reshape(b.truth.shape), None

    def grpo_mean2(b, st):
        return grpo_coefficients(_flat((b.scores[0] + b.scores[1]) / 2)).reshape(b.truth.shape), None

    def drgrpo(b, st):
        return grpo_coefficients(_flat(b.scores[0]), norm_by_std=False).reshape(b.truth.shape), None

    def oracle(b, st):
        return grpo_coefficients(_flat(b.truth)).reshape(b.truth.shape), None

    def range_grpo(b, st):
        return range_advantages(b.scores[0], torch.full_like(b.scores[0], st["range_q"])), None

    def gated(record_key, mean2=False):
        """SetGRPO under the record ``st[record_key]``; with ``mean2`` the training point is the mean of the two
        scorings and the online monitor's reference a third scoring (a diagnostic: the update does not use it, so
        the arm is charged two scorings per response)."""
        def arm(b, st):
            point = (b.scores[0] + b.scores[1]) / 2 if mean2 else b.scores[0]
            reference = b.scores[2] if mean2 else b.scores[1]
            res, a, acc = _setgrpo(point, b.gram, st[record_key])
            st.setdefault(record_key + "/monitor", OnlineRiskMonitor(st[record_key])).update(
                res, _flat(reference), _flat(b.gram))
            return a, acc
        return arm

    def soft(record_key, mean2, scale_key=None):
        def arm(b, st):
            point = (b.scores[0] + b.scores[1]) / 2 if mean2 else b.scores[0]
            w = soft_weights(_flat(point), _flat(b.gram), st[record_key]).reshape(point.shape[:2])
            if scale_key:  # divide by the calibration groups' mean weight: GRPO's step size at the start
                w = w / st[scale_key]
            a = grpo_coefficients(_flat(point)).reshape(point.shape) * w[..., None]
            return a, w > 0
        return arm

    def reliability(step_size_only=False, normalised=False):
        """GRPO on the mean of the two scorings, each group scaled by its reliability weight (core's
        ``reliability_weights``, pooled over each stream's step). ``step_size_only`` spreads the same total weight
        evenly over the step's live groups: a control that separates the weighting from the smaller step.
        ``normalised`` divides the weights by their mean over the step's live groups, so the step keeps GRPO's total
        weight and only its distribution over the groups changes (a step with every weight 0 stays 0)."""
        def arm(b, st):
            m = (b.scores[0] + b.scores[1]) / 2
            w = torch.stack([reliability_weights(b.scores[0][s], b.scores[1][s])[0] for s in range(m.shape[0])])
            live = (~degenerate_groups(_flat(m))).reshape(w.shape).double()
            mean_w = w.sum(-1, keepdim=True) / live.sum(-1, keepdim=True).clamp_min(1)  # over the live groups
            if step_size_only:
                w = live * mean_w
            if normalised:
                w = torch.where(mean_w > 0, w / mean_w.clamp_min(1e-300), 0.0)
            return grpo_coefficients(_flat(m)).reshape(m.shape) * w[..., None], (w > 0 if not step_size_only else None)
        return arm

    def group_reliability(b, st):
        """GRPO on the mean of the two scorings, each group scaled by ``weights_from_noise`` with the noise variance
        of the mean estimated from the group's own K pairs, ``mean_i (r_i - r'_i)^2 / 4``: a group whose two scorings
        disagree is down-weighted by its own disagreement rather than the step's average."""
        m = (b.scores[0] + b.scores[1]) / 2
        noise = (b.scores[0] - b.scores[1]).square().mean(-1) / 4  # [S, G]
        return _weighted_grpo(m, noise)

    def prompt_reliability(b, st):
        """GRPO on the mean of the two scorings, each group scaled by ``weights_from_noise`` with the noise variance
        of the mean of its prompt: ``(r - r')^2 / 4`` summed over every pair of scorings the stream has drawn for
        that prompt so far, this group's included, plus one group's worth (K pairs) of the step's pooled value as a
        prior, over their count. A judge that grades some rubrics worse than others does so each time a prompt comes
        back, so a prompt's record of disagreement says more than one group's K pairs. The sums are the arm's state
        (per stream, as the online monitor's)."""
        m = (b.scores[0] + b.scores[1]) / 2
        d = (b.scores[0] - b.scores[1]).square() / 4                      # [S, G, K]
        s_, g_, k = d.shape
        size = int(b.prompt.max()) + 1
        total = st.setdefault("prompt/sum", torch.zeros(s_, 0, dtype=torch.float64))
        count = st.setdefault("prompt/count", torch.zeros(s_, 0, dtype=torch.float64))
        if total.shape[1] < size:
            total = st["prompt/sum"] = torch.cat([total, total.new_zeros(s_, size - total.shape[1])], 1)
            count = st["prompt/count"] = torch.cat([count, count.new_zeros(s_, size - count.shape[1])], 1)
        total.scatter_add_(1, b.prompt, d.sum(-1))
        count.scatter_add_(1, b.prompt, torch.full((s_, g_), float(k), dtype=torch.float64))
        pooled = d.mean(dim=(1, 2))[:, None]                               # [S, 1]
        noise = (total.gather(1, b.prompt) + k * pooled) / (count.gather(1, b.prompt) + k)
        return _weighted_grpo(m, noise)

    def known_reliability(b, st):
        """Not a method: the reliability weight with the exact noise variance of each group's mean of two scorings,
        from the grader's rates and the truth verdicts (``Batch.noise_var``), which no run knows."""
        m = (b.scores[0] + b.scores[1]) / 2
        noise = b.noise_var.mean(-1) / 2                                   # [S, G]
        return _weighted_grpo(m, noise)

    def sampled_reliability(share):
        """Reliability weights at about one scoring per response: every response is scored once, and the first
        ``share`` of each step's groups (the groups are drawn at random) a second time, only to pool the grader's
        noise variance over the step. A re-scored group trains on the mean of its two scorings (noise variance
        halved), every other group on its one scoring; each group is scaled by core's ``weights_from_noise`` with
        its own point's noise variance."""
        def arm(b, st):
            p0, p1 = b.scores[0], b.scores[1]
            n2 = share * p0.shape[1]
            if n2 != int(n2) or n2 < 1:
                raise ValueError(f"setgrpo_reliability_sampled scores {share:g} of a step's groups twice (its "
                                 f"scorings count): use --groups a multiple of {round(1 / share)}, not {p0.shape[1]}")
            n2 = int(n2)
            twice = torch.arange(p0.shape[1]) < n2
            point = torch.where(twice[None, :, None], (p0 + p1) / 2, p0)
            var1 = (p0[:, :n2] - p1[:, :n2]).square().mean(dim=(1, 2)) / 2  # [S] one scoring's noise variance
            noise = var1[:, None] / torch.where(twice, 2.0, 1.0)[None, :]
            return _weighted_grpo(point, noise)
        return arm

    def online(b, st):
        """Rolling calibration: the record is refitted every ``ONLINE_EVERY`` steps on the last ``ONLINE_WINDOW``
        groups of the stream's own training steps (point, reference, Gram at the policies that drew them)."""
        hist = st.setdefault("online/history", [])
        hist.append((b.scores[0], b.scores[1], b.gram))
        del hist[:-ONLINE_WINDOW_STEPS]
        if len(hist) % ONLINE_EVERY == 0 or "online/records" not in st:
            if len(hist) >= ONLINE_EVERY:
                st["online/records"] = [
                    calibrate_levels(*(torch.cat([h[i][s] for h in hist]) for i in range(3)), LOOSE_LEVELS)
                    for s in range(b.truth.shape[0])]
            else:
                st["online/records"] = [st["loose"]] * b.truth.shape[0]
        a, acc = torch.zeros_like(b.truth), torch.zeros(b.truth.shape[:2], dtype=torch.bool)
        for s, rec in enumerate(st["online/records"]):
            res = setgrpo_coefficients(b.scores[0][s], b.gram[s], rec)
            a[s], acc[s] = res.coefficients, res.accepted
        return a, acc

    def posterior(b, st):
        """GRPO on the verdicts' posterior means given both scorings (:func:`verdict_posterior_scores`), the flip
        rate pooled over the step's verdict pairs (:func:`flip_rate_from_pairs`)."""
        live = b.points > 0
        q = flip_rate_from_pairs(b.observed[0], b.observed[1], live)
        r = verdict_posterior_scores(b.observed[:2], b.points, q)
        return grpo_coefficients(_flat(r)).reshape(r.shape), None

    def posterior_one(b, st):
        """GRPO on the verdicts' posterior means given one scoring, the flip rate estimated once from the
        calibration groups' two scorings (``st["posterior/q"]``): one scoring per response in training."""
        q = torch.full((b.truth.shape[0],), st["posterior/q"], dtype=torch.float64)
        r = verdict_posterior_scores(b.observed[:1], b.points, q)
        return grpo_coefficients(_flat(r)).reshape(r.shape), None

    return {a.name: a for a in [
        Arm("grpo", 1, grpo), Arm("grpo_mean2", 2, grpo_mean2), Arm("drgrpo", 1, drgrpo), Arm("oracle", 0, oracle),
        Arm("range_grpo", 1, range_grpo, "range_q"),
        Arm("setgrpo_paper", 2, gated("paper"), "paper"), Arm("setgrpo", 2, gated("default"), "default"),
        Arm("setgrpo_loose", 2, gated("loose"), "loose"),
        Arm("setgrpo_mean2", 2, gated("mean2", mean2=True), "mean2"),
        Arm("setgrpo_online", 2, online, "loose"),
        Arm("setgrpo_mean2_paper", 2, gated("mean2_paper", mean2=True), "mean2_paper"),
        Arm("setgrpo_mean2_wide", 2, gated("mean2_wide", mean2=True), "mean2_wide"),
        Arm("setgrpo_soft", 1, soft("loose", mean2=False), "loose"),
        Arm("setgrpo_soft_mean2", 2, soft("mean2", mean2=True, scale_key="mean2/soft_scale"), "mean2"),
        Arm("setgrpo_reliability", 2, reliability()),
        Arm("grpo_mean2_stepsize", 2, reliability(step_size_only=True)),
        Arm("setgrpo_reliability_norm", 2, reliability(normalised=True)),
        Arm("setgrpo_reliability_sampled", 1.25, sampled_reliability(0.25)),
        Arm("setgrpo_reliability_group", 2, group_reliability),
        Arm("setgrpo_reliability_prompt", 2, prompt_reliability),
        Arm("oracle_noise", 2, known_reliability),
        Arm("setgrpo_posterior", 2, posterior),
        Arm("setgrpo_posterior_one", 1, posterior_one, "posterior/q"),
    ]}


# --------------------------------------------------------------------------------------------------- calibration
def calibration_data(world: World, k: int, groups: int, grader: Grader, seed: int) -> Batch:
    """``groups`` groups at the initial (uniform) policy with three independent scorings."""
    g = torch.Generator().manual_seed(10_000 + seed)
    prompt = torch.randint(0, world.phi.shape[0], (1, groups), generator=g)
    uniform = torch.rand(1, groups, k, generator=g, dtype=torch.float64)
    flips = torch.rand(3, 1, groups, k, 6, generator=g, dtype=torch.float64)
    return draw(world, torch.zeros(1, world.phi.shape[-1], dtype=torch.float64), prompt, uniform, flips, grader)


def calibrate_levels(point, reference, gram, levels: dict) -> CalibrationRecord:
    """The library's ``calibrate`` at ``levels`` (alpha, beta, delta), every other setting the product's default;
    ``reject_all`` when nothing certifies, so that the arm trains no group and says so."""
    settings = CalibrationSettings(alpha=levels["alpha"], beta=levels["beta"], delta=levels["delta"],
                                   on_infeasible="reject_all", coverage_groups=None)
    return calibrate(point, reference, gram, settings)


def range_half_width(point: torch.Tensor, reference: torch.Tensor) -> float:
    """Range-GRPO's half-width: the split-conformal (1 - alpha) quantile (core's ``conformal_radius``, alpha of
    ``LOOSE_LEVELS``) of the responses' ``|point - reference|`` (``[G, K]`` each), so a range covers a re-scoring."""
    return conformal_radius((point - reference).abs().flatten(), LOOSE_LEVELS["alpha"])


def calibrate_arms(data: Batch) -> tuple[dict, dict]:
    """The records and widths the arms use, and their calibration grader calls per record."""
    p0, p1, p2, gram = (_flat(x) for x in (*data.scores, data.gram))
    mean2 = (p0 + p1) / 2
    default = {k: PRODUCT_DEFAULT[k] for k in PAPER_LEVELS}
    state = {"paper": calibrate_levels(p0, p1, gram, PAPER_LEVELS),
             "loose": calibrate_levels(p0, p1, gram, LOOSE_LEVELS),
             "mean2": calibrate_levels(mean2, p2, gram, LOOSE_LEVELS),
             "mean2_paper": calibrate_levels(mean2, p2, gram, PAPER_LEVELS),
             "mean2_wide": calibrate_levels(mean2, p2, gram, WIDE_LEVELS)}
    state["default"] = state["paper"] if default == PAPER_LEVELS else calibrate_levels(p0, p1, gram, default)
    live = ~degenerate_groups(mean2)
    state["mean2/soft_scale"] = float(soft_weights(mean2[live], gram[live], state["mean2"]).mean())
    state["range_q"] = range_half_width(p0, p1)
    state["posterior/q"] = float(flip_rate_from_pairs(data.observed[0], data.observed[1], data.points > 0)[0])
    calls = {"paper": 2, "default": 2, "loose": 2, "mean2": 3, "mean2_paper": 3, "mean2_wide": 3, "range_q": 2,
             "posterior/q": 2}
    return state, {key: c * p0.numel() for key, c in calls.items()}


# --------------------------------------------------------------------------------------------------- training
@dataclass
class Curves:
    """Per arm: expected truth reward ``[T + 1, S]``, accepted share ``[T, S]`` and update cosines ``[T, S]``."""

    reward: np.ndarray
    accept: np.ndarray
    cos: np.ndarray
    scorings: float


def train(world: World, arms: dict[str, Arm], state: dict, *, k: int, seeds: int, steps: int, groups: int,
          lr: float, grader: Grader, seed0: int = 0, optimizer: str = "sgd") -> dict[str, Curves]:
    """Train every arm for ``steps`` steps on ``seeds`` streams (common random numbers across arms).

    ``optimizer`` is ``"sgd"`` (``theta += lr u``) or ``"adam"`` (one ``torch.optim.AdamW`` step on ``u`` as the
    ascent direction, verl's betas and weight decay; AdamW is elementwise, so the ``[S, D]`` parameters of the
    streams stay independent). Raises ``ValueError`` for another optimizer.
    """
    if optimizer not in TUNE_GRID:
        raise ValueError(f"optimizer {optimizer!r}: use one of {sorted(TUNE_GRID)}")
    d = world.phi.shape[-1]
    theta = {name: torch.zeros(seeds, d, dtype=torch.float64) for name in arms}
    opt = {name: torch.optim.AdamW([theta[name]], lr=lr, betas=ADAM_BETAS, weight_decay=ADAM_WEIGHT_DECAY,
                                   maximize=True) for name in arms} if optimizer == "adam" else {}
    out = {name: Curves(np.zeros((steps + 1, seeds)), np.full((steps, seeds), np.nan), np.zeros((steps, seeds)),
                        arm.scorings) for name, arm in arms.items()}
    for name in arms:
        out[name].reward[0] = expected_truth(world, theta[name]).numpy()
    alias = {"setgrpo": "setgrpo_paper"} if PRODUCT_DEFAULT == {"variant": "paper", **PAPER_LEVELS} else {}
    alias = {a: b for a, b in alias.items() if a in arms and b in arms}
    for t in range(steps):
        g = torch.Generator().manual_seed(seed0 * 1_000_003 + t)
        prompt = torch.randint(0, world.phi.shape[0], (seeds, groups), generator=g)
        uniform = torch.rand(seeds, groups, k, generator=g, dtype=torch.float64)
        flips = torch.rand(3, seeds, groups, k, 6, generator=g, dtype=torch.float64)
        for name, arm in arms.items():
            if name in alias:  # the same procedure on the same random numbers: the same run
                continue
            batch = draw(world, theta[name], prompt, uniform, flips, grader)
            a, accepted = arm.coefficients(batch, state)
            update = torch.einsum("sgk,sgkd->sd", a, batch.grad) / (groups * k)
            truth_update = torch.einsum("sgk,sgkd->sd", grpo_coefficients(_flat(batch.truth)).reshape(a.shape),
                                        batch.grad)
            if optimizer == "adam":
                theta[name].grad = update
                opt[name].step()
            else:
                theta[name] = theta[name] + lr * update
            norms = update.norm(dim=-1) * truth_update.norm(dim=-1)
            out[name].cos[t] = torch.where(norms > 0, (update * truth_update).sum(-1) / norms.clamp_min(1e-300),
                                           0.0).numpy()
            if accepted is not None:
                live = (~degenerate_groups(_flat(batch.scores[0]))).reshape(seeds, groups).double()
                out[name].accept[t] = ((accepted.double() * live).sum(-1) / live.sum(-1).clamp_min(1)).numpy()
            out[name].reward[t + 1] = expected_truth(world, theta[name]).numpy()
    for name, same in alias.items():
        out[name] = out[same]
    return out


# --------------------------------------------------------------------------------------------------- analysis
def band(x: np.ndarray) -> tuple[float, float]:
    """Mean and 95 % t half-width of the seeds' values ``x [S]``."""
    x = np.asarray(x, dtype=float)
    if x.size < 2:
        return float(x.mean()), math.nan
    return float(x.mean()), float(stats.t.ppf(0.975, x.size - 1) * x.std(ddof=1) / math.sqrt(x.size))


def gain_at_calls(c: Curves, steps: int) -> np.ndarray:
    """Per seed gain at the training grader calls a one-scoring arm spends in ``steps`` steps (the arm's step
    ``steps / scorings``, rounded down)."""
    at = steps if c.scorings <= 1 else math.floor(steps / c.scorings + 1e-9)  # never more calls than grpo's
    return c.reward[at] - c.reward[0]


def analyse(curves: dict[str, Curves], *, flip: float, k: int, grader: str) -> list[dict]:
    """One row per arm: the ``--json`` row format (validation/outcome_lab/README.md#the-lab)."""
    steps = curves["grpo"].accept.shape[0]
    q = max(1, steps // 4)
    rows = []
    for name, c in curves.items():
        gain = c.reward[-1] - c.reward[0]
        row = {"grader": grader, "flip": flip, "K": k, "arm": name, "gain": band(gain)[0], "band": band(gain)[1],
               "gain_calls": band(gain_at_calls(c, steps))[0], "band_calls": band(gain_at_calls(c, steps))[1],
               "scorings": c.scorings, "paired": {}, "paired_calls": {},
               "accept": float(np.nanmean(c.accept)) if not np.isnan(c.accept).all() else None,
               "accept_first_quarter": float(np.nanmean(c.accept[:q])) if not np.isnan(c.accept).all() else None,
               "accept_last_quarter": float(np.nanmean(c.accept[-q:])) if not np.isnan(c.accept).all() else None,
               "cos": float(c.cos.mean()),
               "curve": [round(float(x), 5) for x in c.reward.mean(1)[::CURVE_EVERY]]}
        for ref in ("grpo", "grpo_mean2"):
            row["paired"][ref] = list(band(gain - (curves[ref].reward[-1] - curves[ref].reward[0])))
            row["paired_calls"][ref] = list(band(gain_at_calls(c, steps) - gain_at_calls(curves[ref], steps)))
        rows.append(row)
    return rows


def print_rows(rows: list[dict]) -> None:
    print(f"{'grader':>6} {'flip':>5} {'K':>2} {'arm':>14} {'gain':>7} {'+-':>6} {'vs grpo':>15} {'vs mean2':>15} "
          f"{'vs mean2@calls':>15} {'accept':>13} {'cos':>5}")
    for r in rows:
        acc = "" if r["accept"] is None else f"{r['accept_first_quarter']:.2f}->{r['accept_last_quarter']:.2f}"
        pg, pm, pc = r["paired"]["grpo"], r["paired"]["grpo_mean2"], r["paired_calls"]["grpo_mean2"]
        print(f"{r['grader']:>6} {r['flip']:>5} {r['K']:>2} {r['arm']:>14} {r['gain']:7.4f} {r['band']:6.4f} "
              f"{pg[0]:+7.4f}+-{pg[1]:.4f} {pm[0]:+7.4f}+-{pm[1]:.4f} {pc[0]:+7.4f}+-{pc[1]:.4f} {acc:>13} "
              f"{r['cos']:5.2f}")


def markdown(rows: list[dict], arms: list[str] | None = None, optimizer: str = "sgd") -> str:
    """validation/outcome_lab/README.md's table of ``rows``: gain, paired gain over ``grpo_mean2`` at equal steps and at equal training
    grader calls (mean +- 95 % half-width), paired gain over ``grpo``, accepted share first -> last quarter, cosine.
    A run with another optimizer than SGD gets a first column naming it."""
    lead = "" if optimizer == "sgd" else f"| {optimizer} "
    out = [("| optimizer " if lead else "")
           + "| grader | flip | K | arm | gain | - grpo_mean2 | - grpo_mean2, equal calls | - grpo | accepted | cos |",
           ("| --- " if lead else "") + "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if arms and r["arm"] not in arms:
            continue
        acc = "" if r["accept"] is None else f"{r['accept_first_quarter']:.2f} -> {r['accept_last_quarter']:.2f}"
        pm, pc, pg = r["paired"]["grpo_mean2"], r["paired_calls"]["grpo_mean2"], r["paired"]["grpo"]
        out.append(f"{lead}| {r['grader']} | {r['flip']:g} | {r['K']} | `{r['arm']}` | {r['gain']:.3f} | "
                   f"{pm[0]:+.3f} ± {pm[1]:.3f} | {pc[0]:+.3f} ± {pc[1]:.3f} | {pg[0]:+.3f} ± {pg[1]:.3f} | {acc} | "
                   f"{r['cos']:.2f} |")
    return "\n".join(out)


def plot(rows: list[dict], path: Path, cells=(("flip", 0.1, 4), ("flip", 0.2, 4), ("flip", 0.2, 8)),
         arms=("oracle", "grpo_mean2", "grpo", "setgrpo_reliability", "setgrpo_paper")) -> None:
    """docs/outcome.md's figure: mean expected truth reward against steps, one panel per (grader, flip, K) cell."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(cells), figsize=(4.2 * len(cells), 3.4), sharey=True)
    for ax, (grader, flip, k) in zip(np.atleast_1d(axes), cells):
        for arm in arms:
            r = next(r for r in rows if (r["grader"], r["flip"], r["K"], r["arm"]) == (grader, flip, k, arm))
            steps = np.arange(len(r["curve"])) * CURVE_EVERY
            ax.plot(steps, np.asarray(r["curve"]) - r["curve"][0], label=f"{arm} ({r['gain']:.3f} ± {r['band']:.3f})")
        ax.set_title(f"{grader} grader, flip {flip:g}, K {k}")
        ax.set_xlabel("training step")
        ax.legend(fontsize=7, loc="lower right")
    np.atleast_1d(axes)[0].set_ylabel("truth-reward gain (mean of seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# --------------------------------------------------------------------------------------------------- real geometry
def rescored(shard: dict, flip: float, generator: torch.Generator) -> dict:
    """``shard`` with its point and reference scores drawn again at flip probability ``flip`` from its noise-free
    rule verdicts (``truth_verdicts`` int8 ``[G, K, J]``: 1 met, 0 unmet, -1 no verdict or no criterion J;
    ``criterion_points`` ``[G, J]``): every verdict of each scoring flips independently, as the noisy grader's fresh
    per-call flips do, scored by :func:`rubric_scores`. At ``flip`` 0 the scores are the shard's ``truth``."""
    verdicts, points = shard["truth_verdicts"], shard["criterion_points"][:, None, :]
    out = dict(shard)
    for key in ("point", "reference"):
        flipped = torch.rand(verdicts.shape, generator=generator, dtype=torch.float64) < flip
        out[key] = rubric_scores(verdicts, points, flipped)
    return out


def real_geometry(shard_dir: Path, batches_per_step: int = 1, record: Path | None = None,
                  flip: float | None = None, seed: int = 0) -> dict[str, float]:
    """The arms' per-step alignment with the truth-GRPO update on committed calibration shards.

    Each shard (``batch_*.npz``: point, reference, truth ``[G, K]``, gram ``[G, K, K]`` of a real policy) is one
    step; groups are taken as mutually orthogonal, so ``<u(a), u(b)> = sum_g a_g^T M_g b_g``. The first half of the
    shards calibrates the SetGRPO records, the second half is scored. With ``record`` (a ``record.json``, e.g. the
    one verl's calibration stage wrote from these shards, so in-sample for them) the arm ``setgrpo_record`` applies
    it as the trainer does. With ``flip`` the shards' scores are drawn again at that flip probability from their
    rule verdicts (:func:`rescored`, seeded by ``seed``), so one policy's geometry is measured at other noise
    levels. Returns ``{arm: {"cos": mean cosine, "trained": mean share of groups with a nonzero update,
    "reversed": share of the trained groups whose own update opposes the truth's (``a^T M t < 0``), "steps": scored
    shards}}``; ``reversed`` is over the trained groups whose truth update is not zero (``opposed_groups``: the
    count and its denominator), None where the arm trained none of them.
    """
    files = sorted(shard_dir.glob("batch_*.npz"))
    if not files:
        raise SystemExit(f"no batch_*.npz shards in {shard_dir}")
    keys = ("point", "reference", "truth", "gram")
    if flip is not None:
        keys += ("truth_verdicts", "criterion_points")
    shards = []
    for f in files:
        with np.load(f) as npz:
            missing = [k for k in keys if k not in npz.files]
            if missing:
                raise SystemExit(f"{f}: no {', '.join(missing)}"
                                 + (" (--rescore needs shards that keep the rule verdicts, written since the noisy "
                                    "grader's verdicts were stored)" if flip is not None else ""))
            shards.append({k: torch.from_numpy(npz[k]).double() for k in keys})
    if flip is not None:
        generator = torch.Generator().manual_seed(seed)
        shards = [rescored(s, flip, generator) for s in shards]
    half = len(shards) // 2
    cal = {k: torch.cat([s[k] for s in shards[:half]]) for k in ("point", "reference", "gram")}
    records = {"setgrpo_paper": calibrate_levels(cal["point"], cal["reference"], cal["gram"], PAPER_LEVELS),
               "setgrpo_loose": calibrate_levels(cal["point"], cal["reference"], cal["gram"], LOOSE_LEVELS)}
    q = range_half_width(cal["point"], cal["reference"])
    arms = {"grpo": lambda s: grpo_coefficients(s["point"]),
            "grpo_mean2": lambda s: grpo_coefficients((s["point"] + s["reference"]) / 2),
            "drgrpo": lambda s: grpo_coefficients(s["point"], norm_by_std=False),
            "range_grpo": lambda s: range_advantages(s["point"], torch.full_like(s["point"], q)),
            **{name: (lambda s, r=rec: setgrpo_coefficients(s["point"], s["gram"], r).coefficients)
               for name, rec in records.items()},
            "setgrpo_soft": lambda s: grpo_coefficients(s["point"]) * soft_weights(
                s["point"], s["gram"], records["setgrpo_loose"])[:, None],
            "setgrpo_reliability": lambda s: reliability_coefficients(s["point"], s["reference"])}
    if record is not None:
        rec = CalibrationRecord.from_json(record)
        arms["setgrpo_record"] = lambda s: setgrpo_coefficients(s["point"], s["gram"], rec).coefficients
    cos = {name: [] for name in arms}
    trained = {name: [] for name in arms}
    # trained groups whose update opposes the truth's, among the trained groups where the truth has a preference
    opposed = {name: [0, 0] for name in arms}
    for s in shards[half:]:
        t = grpo_coefficients(s["truth"])
        tt = torch.einsum("gi,gij,gj->", t, s["gram"], t)
        for name, fn in arms.items():
            a = fn(s)
            aa = torch.einsum("gi,gij,gj->", a, s["gram"], a)
            at = torch.einsum("gi,gij,gj->", a, s["gram"], t)
            cos[name].append(float(at / (aa * tt).sqrt()) if aa > 0 and tt > 0 else 0.0)
            live = a.abs().sum(-1) > 0
            trained[name].append(float(live.double().mean()))
            counted = live & (t.abs().sum(-1) > 0)
            opposed[name][0] += int((torch.einsum("gi,gij,gj->g", a, s["gram"], t)[counted] < 0).sum())
            opposed[name][1] += int(counted.sum())
    return {name: {"cos": float(np.mean(cos[name])), "trained": float(np.mean(trained[name])),
                   "reversed": opposed[name][0] / opposed[name][1] if opposed[name][1] else None,
                   "opposed_groups": opposed[name], "steps": len(cos[name])} for name in arms}


def _share(x: float | None) -> str:
    return "  n/a" if x is None else f"{x:.3f}"


def rescored_geometry(shard_dir: Path, flip: float, draws: int = 20) -> dict[str, dict[str, float]]:
    """:func:`real_geometry` with the scores drawn again at ``flip`` (seeds ``0 .. draws - 1``): the cosine and the
    trained share as means over the draws (one draw of 128 groups moves a cosine by several hundredths), the opposed
    share pooled over every draw's counted groups."""
    runs = [real_geometry(shard_dir, flip=flip, seed=seed) for seed in range(draws)]
    out = {}
    for name in runs[0]:
        opposed = [sum(r[name]["opposed_groups"][i] for r in runs) for i in (0, 1)]
        out[name] = {**{key: float(np.mean([r[name][key] for r in runs])) for key in ("cos", "trained")},
                     "reversed": opposed[0] / opposed[1] if opposed[1] else None, "opposed_groups": opposed,
                     "steps": runs[0][name]["steps"], "draws": draws}
    return out


# --------------------------------------------------------------------------------------------------- command line
def run(*, flips, ks, graders, seeds, steps, groups, calib_groups, lr, arms=None, verbose=True,
        optimizer: str = "sgd") -> list[dict]:
    """Every (grader, flip, K) cell: calibrate, train every arm, analyse. Returns the ``--json`` rows."""
    world = make_world()
    all_arms = make_arms()
    chosen = {n: all_arms[n] for n in (arms or all_arms)}
    for must in ("grpo", "grpo_mean2"):
        chosen.setdefault(must, all_arms[must])
    rows = []
    for grader in graders:
        for flip in flips:
            scorer = make_grader(grader, flip)
            for k in ks:
                t0 = time.perf_counter()
                state, calib_calls = calibrate_arms(calibration_data(world, k, calib_groups, scorer, seed=0))
                curves = train(world, chosen, state, k=k, seeds=seeds, steps=steps, groups=groups, lr=lr,
                               grader=scorer, optimizer=optimizer)
                cell = analyse(curves, flip=flip, k=k, grader=grader)
                for row in cell:
                    key = chosen[row["arm"]].record
                    row["calibration_grader_calls"] = calib_calls.get(key, 0) if key else 0
                    row["training_grader_calls_per_step"] = row["scorings"] * groups * k
                    rec = state.get(key) if key else None
                    rec = rec if isinstance(rec, CalibrationRecord) else None  # widths and rates have no tau or Q
                    row["tau_sel"] = None if rec is None else rec.tau_sel
                    row["q_alpha"] = None if rec is None else rec.q_alpha
                rows += cell
                if verbose:
                    print(f"[grader {grader}, flip {flip}, K {k}: {time.perf_counter() - t0:.0f} s]", flush=True)
                    print_rows(cell)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="the full run's cells at flips 0.05, 0.1, 0.2 with the flip grader only (same numbers)")
    ap.add_argument("--flips", type=float, nargs="+", default=[0.05, 0.1, 0.2, 0.3])
    ap.add_argument("--K", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--graders", nargs="+", choices=GRADERS, default=["flip", "length"])
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--groups", type=int, default=32)
    ap.add_argument("--calib-groups", type=int, default=1000)
    ap.add_argument("--optimizer", choices=sorted(TUNE_GRID), default="sgd",
                    help="sgd: theta += lr u; adam: verl's AdamW (betas 0.9, 0.999, weight decay 0.01)")
    ap.add_argument("--lr", type=float, default=None, help=f"default: {LR:g} (sgd), {ADAM_LR:g} (adam)")
    ap.add_argument("--lr-scale", type=float, default=1.0, help="sensitivity check: 3 and 1/3")
    ap.add_argument("--arms", nargs="+", default=None)
    ap.add_argument("--tune-lr", action="store_true", help="GRPO at flip 0.1, K 4 over the optimizer's grid: " + str(TUNE_GRID))
    ap.add_argument("--shards", type=Path, default=None, help="the real-geometry instrument on a shard directory")
    ap.add_argument("--record", type=Path, default=None,
                    help="with --shards: also apply this record.json as the trainer does (arm setgrpo_record)")
    ap.add_argument("--rescore", type=float, nargs="+", default=None, metavar="FLIP",
                    help="with --shards: also draw the shards' scores again at these flip probabilities from their "
                         "rule verdicts")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--markdown", type=Path, default=None, help="print validation/outcome_lab/README.md's table of a --json file")
    ap.add_argument("--plot", type=Path, nargs=2, default=None, metavar=("JSON", "PNG"),
                    help="draw docs/outcome.md's figure from a --json file")
    args = ap.parse_args(argv)
    if (args.record is not None or args.rescore is not None) and args.shards is None:
        ap.error("--record and --rescore work on real geometry: pass them with --shards DIR")
    for flip in args.rescore or ():
        if not 0.0 <= flip < 1.0:
            ap.error(f"--rescore {flip:g}: a flip probability is in [0, 1)")
    if args.plot is not None:
        plot(json.loads(args.plot[0].read_text())["rows"], args.plot[1])
        return
    if args.markdown is not None:
        run_json = json.loads(args.markdown.read_text())
        print(markdown(run_json["rows"], args.arms, run_json["meta"].get("optimizer", "sgd")))
        return
    if args.shards is not None:
        cos = real_geometry(args.shards, record=args.record)
        print("real geometry: mean cosine with the truth-GRPO update per step, share of groups trained, share of "
              "trained groups opposing the truth")
        for name, c in cos.items():
            print(f"  {name:>14} {c['cos']:.3f} {c['trained']:.3f} {_share(c['reversed'])}")
        out = {"real_geometry": cos}
        for flip in args.rescore or ():
            out.setdefault("rescored", {})[f"{flip:g}"] = again = rescored_geometry(args.shards, flip)
            print(f"re-scored at flip {flip:g} (mean of {next(iter(again.values()))['draws']} draws):")
            for name, c in again.items():
                print(f"  {name:>14} {c['cos']:.3f} {c['trained']:.3f} {_share(c['reversed'])}")
        if args.json:
            args.json.write_text(json.dumps(out, indent=1))
        return
    if args.quick:
        args.flips = [f for f in args.flips if f <= 0.2] if args.flips == [0.05, 0.1, 0.2, 0.3] else args.flips
        args.graders = ["flip"] if args.graders == ["flip", "length"] else args.graders
    if args.lr is None:
        args.lr = ADAM_LR if args.optimizer == "adam" else LR
    if args.tune_lr:
        for scale in TUNE_GRID[args.optimizer]:
            rows = run(flips=[0.1], ks=[4], graders=["flip"], seeds=args.seeds, steps=args.steps, groups=args.groups,
                       calib_groups=args.calib_groups, lr=scale, arms=["grpo"], verbose=False,
                       optimizer=args.optimizer)
            r = next(r for r in rows if r["arm"] == "grpo")
            print(f"lr {scale:g}: grpo gain {r['gain']:.4f} +- {r['band']:.4f}")
        return
    t0 = time.perf_counter()
    rows = run(flips=args.flips, ks=args.K, graders=args.graders, seeds=args.seeds, steps=args.steps,
               groups=args.groups, calib_groups=args.calib_groups, lr=args.lr * args.lr_scale, arms=args.arms,
               optimizer=args.optimizer)
    meta = {"optimizer": args.optimizer, "seeds": args.seeds, "steps": args.steps, "groups": args.groups, "calib_groups": args.calib_groups,
            "lr": args.lr * args.lr_scale, "seconds": time.perf_counter() - t0}
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    default = [r for r in rows if r["arm"] == "setgrpo"]
    for r in default:
        print(f"outcome lab: setgrpo {r['grader']} flip {r['flip']} K {r['K']}: gain {r['gain']:.4f}, "
              f"- grpo_mean2 {r['paired']['grpo_mean2'][0]:+.4f} +- {r['paired']['grpo_mean2'][1]:.4f} "
              f"(at equal calls {r['paired_calls']['grpo_mean2'][0]:+.4f}), "
              f"- grpo {r['paired']['grpo'][0]:+.4f} +- {r['paired']['grpo'][1]:.4f}")


if __name__ == "__main__":
    main()
