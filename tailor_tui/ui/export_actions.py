"""e: export the composition as a plain HF model folder, for evaluation (a mixin of the composer's screen).

Asks for the folder (beside the output by default), plans the export in a thread, then runs it
on the progress screen (one bar per source rank, Esc cancels, nothing left behind). The same
backend as `tailor-tui --export` (`export_plan`, `export`). A DeepSpeed-layout run records no
config.json: the model's config is asked for too (as `--config`); left empty, the folder holds
the weights and the notice says how to add one.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING

from textual import work

from tailor_tui.checkpoints.cache import cache_dir
from tailor_tui.checkpoints.dcp_checkpoint import is_dcp
from tailor_tui.errors import TailorError
from tailor_tui.export.dcp_to_hf import DcpHfExport, plan_dcp_hf
from tailor_tui.export.export_plan import plan_export
from tailor_tui.export.export_run import config_file, config_source
from tailor_tui.formats.safetensors_out import parse_size
from tailor_tui.health.guard import nonfinite_lines, planned_nonfinite
from tailor_tui.planning.build import build_plan
from tailor_tui.planning.dcp_plan import plan_dcp
from tailor_tui.ui.dialogs import Answer, ErrorDialog, PathPrompt, PlanDialog
from tailor_tui.ui.messages import ExportReady
from tailor_tui.ui.progress_screen import ProgressScreen
from tailor_tui.units import shown

if TYPE_CHECKING:
    from tailor_tui.planning.recipe import Recipe
    from tailor_tui.ui.host import ComposerHost

DEFAULT_SHARD = "5GB"


class ExportActions:
    def action_export(self: ComposerHost) -> None:
        if not self.editable():
            return
        comp = self.active_composition
        output = comp.output or comp.default_output()
        default = output.with_name(output.name + "-hf")

        def chosen(value: str | None) -> None:
            if not value:
                return
            recipe = dataclasses.replace(comp.to_recipe(), output=Path(os.path.expanduser(value)))
            if comp.base_checkpoint.folder.model_config:  # the config comes with the base
                self.export_worker(recipe, None)
                return

            def with_config(config: str | None) -> None:
                if config is not None:  # Esc cancels the export; empty: the weights only
                    self.export_worker(recipe, Path(os.path.expanduser(config)) if config else None)

            self.app.push_screen(PathPrompt("The model's config.json, or a folder with it and its tokenizer "
                                        "(a DeepSpeed-layout or DCP run records none)",
                                        placeholder="empty: export the weights only"), with_config)

        self.app.push_screen(PathPrompt("Export for evaluation (a plain HF model folder) to", str(default)), chosen)

    @work(thread=True, exclusive=True, group="plan")
    def export_worker(self: ComposerHost, recipe: Recipe, config: Path | None) -> None:
        try:
            if is_dcp(recipe.base):  # a composition of PyTorch Distributed Checkpoints: its writers refuse NaN/Inf
                found = plan_dcp_hf(plan_dcp(recipe), None, parse_size(DEFAULT_SHARD), allow_nonfinite=False)
                self.post_message(ExportReady(found, config_file(config) if config is not None else None))
                return
            export = plan_export(build_plan(recipe), None, parse_size(DEFAULT_SHARD))
            config_source(export, config)  # a folder without config.json is said now, not after the weights
            # the rows it would take NaN/Inf from, by their checkpoints' statistics (computed here if absent)
            self.post_message(ExportReady(export, config, dict(planned_nonfinite(export.plan, cache=cache_dir()))))
        except TailorError as exc:
            self.app.call_from_thread(self.export_failed, str(exc))

    def on_export_ready(self: ComposerHost, message: ExportReady) -> None:
        if not message.nonfinite:
            self.start_export(message)
            return
        body = "\n".join(["✗ the exported model would hold non-finite values:",
                          *map(shown, nonfinite_lines(message.export.plan, message.nonfinite)),
                          "Enter goes back (h heals them); ! exports anyway, as --export --allow-nonfinite does"])

        def answer(yes: Answer) -> None:
            if yes is True:
                self.start_export(message)

        self.app.push_screen(PlanDialog("Export this model?", body, accept="Export anyway", decline="Back",
                                        risky=True), answer)

    def start_export(self: ComposerHost, message: ExportReady) -> None:
        """Run the export on the progress screen."""
        export = message.export
        if (message.config if isinstance(export, DcpHfExport) else config_source(export, message.config)) is None:
            self.notify("no config.json for this model: the folder will hold the weights only; export again "
                        "and give its config.json (or tailor-tui --export … --config PATH)", severity="warning",
                        timeout=10)
        self.composing = True
        self.app.push_screen(ProgressScreen(export.plan, self.options.workers, clock=self.options.clock,
                                         options=self.options.compose_options,
                                         title=f"Exporting {self.rel(export.plan.output)}", export=export,
                                         export_config=message.config,
                                         finished=self.compose_finished),
                             self.compose_closed)

    def export_failed(self: ComposerHost, message: str) -> None:
        self.app.push_screen(ErrorDialog(message, title="Cannot export"))
