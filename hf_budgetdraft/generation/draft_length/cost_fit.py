"""The running cost fit the adaptive policies share: `y ≈ intercept + slope·x` over a call's rounds."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DecayedLinearFit:
    """Weighted least squares `y ≈ intercept + slope·x` with exponential forgetting and a ridge pull of the slope
    towards `prior_slope · intercept` (few distinct x early in a call make the plain fit ill-posed)."""

    decay: float
    prior_slope_ratio: float
    ridge: float = 4.0
    sums: list[float] = field(default_factory=lambda: [0.0] * 5)  # Σw, Σwx, Σwxx, Σwy, Σwxy

    def add(self, x: float, y: float) -> None:
        self.sums = [s * self.decay for s in self.sums]
        for i, term in enumerate((1.0, x, x * x, y, x * y)):
            self.sums[i] += term

    @property
    def count(self) -> float:
        return self.sums[0]

    def coefficients(self) -> tuple[float, float]:
        w, wx, wxx, wy, wxy = self.sums
        mean_x, mean_y = wx / w, wy / w
        sxx, sxy = wxx - w * mean_x**2, wxy - w * mean_x * mean_y
        # the prior slope scales with the cost level, estimated as the mean (the intercept is not known yet)
        prior = self.prior_slope_ratio * mean_y
        slope = max(0.0, (sxy + self.ridge * prior) / (sxx + self.ridge))
        intercept = max(1e-6, mean_y - slope * mean_x)
        return intercept, slope
