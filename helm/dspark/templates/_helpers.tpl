{{/* Names ---------------------------------------------------------------------------------- */}}

{{- define "dspark.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Fully qualified app name, kept short enough for "-server-headless" suffixes. */}}
{{- define "dspark.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "dspark.serverName" -}}{{ include "dspark.fullname" . }}-server{{- end }}
{{- define "dspark.headlessName" -}}{{ include "dspark.fullname" . }}-server-headless{{- end }}
{{- define "dspark.routerName" -}}{{ include "dspark.fullname" . }}-router{{- end }}

{{- define "dspark.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels ---------------------------------------------------------------------------------- */}}

{{- define "dspark.selectorLabels" -}}
app.kubernetes.io/name: {{ include "dspark.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "dspark.labels" -}}
helm.sh/chart: {{ include "dspark.chart" . }}
{{ include "dspark.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: dspark
{{- end }}

{{/* Usage: include "dspark.componentLabels" (dict "ctx" $ "component" "server") */}}
{{- define "dspark.componentSelectorLabels" -}}
{{ include "dspark.selectorLabels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "dspark.componentLabels" -}}
{{ include "dspark.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Images ---------------------------------------------------------------------------------- */}}

{{- define "dspark.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* Usage: include "dspark.imageOr" (dict "ctx" $ "image" .Values.router.image) */}}
{{- define "dspark.imageOr" -}}
{{- $repo := default .ctx.Values.image.repository .image.repository }}
{{- $tag := default (default .ctx.Chart.AppVersion .ctx.Values.image.tag) .image.tag }}
{{- printf "%s:%s" $repo $tag }}
{{- end }}

{{- define "dspark.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "dspark.serverName" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Models ---------------------------------------------------------------------------------- */}}

{{/* Path a model is read from. Usage: include "dspark.modelPath" (dict "ctx" $ "model" .Values.models.target) */}}
{{- define "dspark.modelPath" -}}
{{- if .model.path }}
{{- .model.path }}
{{- else if .model.repo }}
{{- printf "%s/%s" (trimSuffix "/" .ctx.Values.models.mountPath) .model.repo }}
{{- end }}
{{- end }}

{{- define "dspark.targetPath" -}}
{{- $p := include "dspark.modelPath" (dict "ctx" . "model" .Values.models.target) }}
{{- if not $p }}
{{- fail "models.target: set repo (a Hugging Face id) or path (where the target model is in the container)" }}
{{- end }}
{{- $p }}
{{- end }}

{{- define "dspark.draftPath" -}}
{{- include "dspark.modelPath" (dict "ctx" . "model" .Values.models.draft) }}
{{- end }}

{{/* Whether the pods mount a model volume at models.mountPath. */}}
{{- define "dspark.hasModelVolume" -}}
{{- if ne .Values.models.source "image" }}true{{ end }}
{{- end }}

{{/* Derived settings ------------------------------------------------------------------------ */}}

{{- define "dspark.isCPU" -}}
{{- if eq .Values.server.device "cpu" }}true{{ end }}
{{- end }}

{{/* GPUs per server pod (per node with server.multiNode). */}}
{{- define "dspark.gpus" -}}
{{- if not (kindIs "invalid" .Values.server.gpus) }}
{{- .Values.server.gpus | int }}
{{- else if include "dspark.isCPU" . }}
{{- 0 }}
{{- else }}
{{- div (mul (int .Values.server.tpSize) (int .Values.server.dpSize)) (include "dspark.podsPerReplica" . | int) }}
{{- end }}
{{- end }}

{{/* "true" when each server replica is a LeaderWorkerSet group of several nodes. */}}
{{- define "dspark.multiNode" -}}
{{- if .Values.server.multiNode.enabled }}true{{ end }}
{{- end }}

{{/* Pods per server replica: 1, or server.multiNode.nodes. */}}
{{- define "dspark.podsPerReplica" -}}
{{- if include "dspark.multiNode" . }}{{ int .Values.server.multiNode.nodes }}{{ else }}1{{ end }}
{{- end }}

{{/* The server workload: a StatefulSet named <release>-server, or a LeaderWorkerSet named
<release>-server-lws (LWS creates a headless Service of its own name; <release>-server stays
the chart's ClusterIP Service). */}}
{{- define "dspark.workloadName" -}}
{{- if include "dspark.multiNode" . }}{{ include "dspark.serverName" . }}-lws{{ else }}{{ include "dspark.serverName" . }}{{ end }}
{{- end }}

{{- define "dspark.workloadAPIVersion" -}}
{{- if include "dspark.multiNode" . }}leaderworkerset.x-k8s.io/v1{{ else }}apps/v1{{ end }}
{{- end }}

{{- define "dspark.workloadKind" -}}
{{- if include "dspark.multiNode" . }}LeaderWorkerSet{{ else }}StatefulSet{{ end }}
{{- end }}

{{/* Labels that pick the pods serving the API: every server pod, or only the leaders of
multi-node groups (workers answer /health only). */}}
{{- define "dspark.apiPodSelectorLabels" -}}
{{ include "dspark.componentSelectorLabels" (dict "ctx" . "component" "server") }}
{{- if include "dspark.multiNode" . }}
dspark.io/role: leader
{{- end }}
{{- end }}

{{/* Stable DNS name of server replica i, for the static router list. With PD (pd: prefill
or decode), replica i of that role's StatefulSet. Usage: include "dspark.replicaHost" (dict
"ctx" $ "i" 0 "pd" "") */}}
{{- define "dspark.replicaHost" -}}
{{- if include "dspark.multiNode" .ctx }}
{{- printf "%s-%d.%s.%s.svc" (include "dspark.workloadName" .ctx) (int .i) (include "dspark.workloadName" .ctx) .ctx.Release.Namespace }}
{{- else }}
{{- printf "%s-%d.%s.%s.svc" (include "dspark.pdWorkloadName" (dict "ctx" .ctx "pd" (.pd | default ""))) (int .i) (include "dspark.headlessName" .ctx) .ctx.Release.Namespace }}
{{- end }}
{{- end }}

{{/* Replicas the fleet has at its smallest (the autoscaler's minimum when it owns them; with
PD the decode replicas, where requests run to completion). */}}
{{- define "dspark.minReplicas" -}}
{{- if include "dspark.pd" . }}{{ int .Values.server.disaggregation.decode.replicas }}
{{- else if .Values.autoscaling.enabled }}{{ int .Values.autoscaling.minReplicas }}{{ else }}{{ int .Values.server.replicas }}{{ end }}
{{- end }}

{{/* Prefill/decode disaggregation ------------------------------------------------------ */}}

{{/* "true" when the servers are split into a prefill and a decode role. */}}
{{- define "dspark.pd" -}}
{{- if .Values.server.disaggregation.enabled }}true{{ end }}
{{- end }}

{{/* The server roles as a JSON list: [""] (one StatefulSet, no PD) or ["prefill","decode"]. */}}
{{- define "dspark.pdRoles" -}}
{{- if include "dspark.pd" . }}["prefill","decode"]{{ else }}[""]{{ end }}
{{- end }}

{{/* StatefulSet of a role: <release>-server, or <release>-prefill / <release>-decode (short
enough for the controller-revision-hash label: name + 11 characters <= 63). Usage:
include "dspark.pdWorkloadName" (dict "ctx" $ "pd" "prefill") */}}
{{- define "dspark.pdWorkloadName" -}}
{{- if .pd }}{{ include "dspark.fullname" .ctx }}-{{ .pd }}{{ else }}{{ include "dspark.serverName" .ctx }}{{ end }}
{{- end }}

{{/* Selector labels of a role's pods: the server's, plus dspark.io/pd-role with PD. */}}
{{- define "dspark.pdSelectorLabels" -}}
{{ include "dspark.componentSelectorLabels" (dict "ctx" .ctx "component" "server") }}
{{- if .pd }}
dspark.io/pd-role: {{ .pd }}
{{- end }}
{{- end }}

{{/* Replicas of a role (server.replicas without PD). */}}
{{- define "dspark.pdReplicas" -}}
{{- if .pd }}{{ int (index .ctx.Values.server.disaggregation .pd).replicas }}{{ else }}{{ int .ctx.Values.server.replicas }}{{ end }}
{{- end }}

{{/* PodDisruptionBudget spec body. With neither value set: maxUnavailable 1 when there are
2+ replicas (a multi-node group whose pod is evicted restarts whole, so its pods count as
unavailable and the next eviction waits for it); minAvailable = every pod when there is one
replica, so a drain waits instead of evicting the only one. Usage: include "dspark.pdbSpec" (dict "pdb" .Values.server.pdb
"replicas" 1 "podsPerReplica" 1) */}}
{{- define "dspark.pdbSpec" -}}
{{- if not (kindIs "invalid" .pdb.minAvailable) }}
minAvailable: {{ .pdb.minAvailable }}
{{- else if not (kindIs "invalid" .pdb.maxUnavailable) }}
maxUnavailable: {{ .pdb.maxUnavailable }}
{{- else if le (int .replicas) 1 }}
minAvailable: {{ int .podsPerReplica }}
{{- else }}
maxUnavailable: 1
{{- end }}
{{- end }}

{{/* Fully qualified name another release of this chart gets (no overrides), for A/B arms. */}}
{{- define "dspark.fullnameOf" -}}
{{- if contains .ctx.Chart.Name .release }}
{{- .release | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .release .ctx.Chart.Name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/* Router Service sessionAffinity: "" = ClientIP for a cache-aware router with replicas > 1. */}}
{{- define "dspark.routerSessionAffinity" -}}
{{- $r := .Values.router }}
{{- if $r.service.sessionAffinity }}{{ $r.service.sessionAffinity }}
{{- else if and (eq $r.policy "cache_aware") (gt (int $r.replicas) 1) }}ClientIP
{{- else }}None{{ end }}
{{- end }}

{{/* Concurrency levels of the load test: loadtest.users, or 1, 2, 4, ... up to capacity
(server.maxRunningRequests x the replicas a run starts on). */}}
{{- define "dspark.loadtestUsers" -}}
{{- if .Values.loadtest.users }}
{{- .Values.loadtest.users }}
{{- else }}
{{- $perReplica := 48 }}
{{- if not (kindIs "invalid" .Values.server.maxRunningRequests) }}{{ $perReplica = int .Values.server.maxRunningRequests }}{{ end }}
{{- /* the fleet a run starts on: server.replicas, or the autoscaler's minimum */}}
{{- $cap := mul $perReplica (max 1 (include "dspark.minReplicas" . | int)) }}
{{- $levels := list }}
{{- $u := 1 }}
{{- range until 20 }}
{{- if lt $u $cap }}{{ $levels = append $levels $u }}{{ $u = mul $u 2 }}{{ end }}
{{- end }}
{{- $levels = append $levels $cap }}
{{- join "," $levels }}
{{- end }}
{{- end }}

{{- define "dspark.isEagle" -}}
{{- if has .Values.speculative.algorithm (list "EAGLE" "EAGLE3" "NEXTN") }}true{{ end }}
{{- end }}

{{- define "dspark.calibrationConfigMap" -}}
{{- if .cfg.existingConfigMap }}{{ .cfg.existingConfigMap }}{{ else }}{{ include "dspark.fullname" .ctx }}-calibration{{ end }}
{{- end }}

{{/* Whether the chart must create the calibration ConfigMap. */}}
{{- define "dspark.ownsCalibration" -}}
{{- $c := .Values.calibration }}
{{- if or (and (include "dspark.calibrationOn" $c.sts) (not $c.sts.existingConfigMap)) (and (include "dspark.calibrationOn" $c.sps) (not $c.sps.existingConfigMap)) }}true{{ end }}
{{- end }}

{{/* Calibration file content as JSON text. Usage: include "dspark.calibrationJSON" (dict "name" "sts" "cfg" .Values.calibration.sts) */}}
{{- define "dspark.calibrationJSON" -}}
{{- if kindIs "string" .cfg.content }}
{{- if not (trim .cfg.content) }}
{{- fail (printf "calibration.%s.enabled is true but calibration.%s.content is empty; set content (JSON) or existingConfigMap" .name .name) }}
{{- end }}
{{- .cfg.content }}
{{- else }}
{{- if not .cfg.content }}
{{- fail (printf "calibration.%s.enabled is true but calibration.%s.content is empty; set content (JSON) or existingConfigMap" .name .name) }}
{{- end }}
{{- toPrettyJson .cfg.content }}
{{- end }}
{{- end }}

{{/* URL clients use: the router when enabled, else the server Service. */}}
{{- define "dspark.apiHost" -}}
{{- if .Values.router.enabled }}
{{- printf "%s.%s.svc" (include "dspark.routerName" .) .Release.Namespace }}
{{- else }}
{{- printf "%s.%s.svc" (include "dspark.serverName" .) .Release.Namespace }}
{{- end }}
{{- end }}

{{- define "dspark.apiURL" -}}
{{- if .Values.router.enabled }}
{{- printf "http://%s:%v" (include "dspark.apiHost" .) .Values.router.service.port }}
{{- else }}
{{- printf "http://%s:%v" (include "dspark.apiHost" .) .Values.server.service.port }}
{{- end }}
{{- end }}

{{/* Cross-field checks the schema cannot express. */}}
{{- define "dspark.validate" -}}
{{- range $where, $envs := dict "models.download.extraEnv" .Values.models.download.extraEnv "server.env" .Values.server.env "router.env" .Values.router.env }}
{{- range $envs }}
{{- if and (has .name (list "HF_TOKEN" "HUGGING_FACE_HUB_TOKEN")) (hasKey . "value") }}
{{- fail (printf "%s sets %s as a plain value; keep tokens in a Secret and set models.download.hfTokenSecret.name instead" $where .name) }}
{{- end }}
{{- end }}
{{- end }}
{{- if and .Values.autoscaling.enabled .Values.router.enabled (eq .Values.router.discovery "static") }}
{{- fail "autoscaling.enabled needs router.discovery=kubernetes: a static worker list cannot follow the autoscaler" }}
{{- end }}
{{- if and .Values.autoscaling.enabled (lt (int .Values.autoscaling.maxReplicas) (int .Values.autoscaling.minReplicas)) }}
{{- fail (printf "autoscaling.maxReplicas (%v) must be >= autoscaling.minReplicas (%v)" .Values.autoscaling.maxReplicas .Values.autoscaling.minReplicas) }}
{{- end }}
{{- $s := .Values.server }}
{{- $gpus := include "dspark.gpus" . | int }}
{{- $world := mul (int $s.tpSize) (int $s.dpSize) }}
{{- $pods := include "dspark.podsPerReplica" . | int }}
{{- if include "dspark.multiNode" . }}
{{- if include "dspark.isCPU" . }}
{{- fail "server.multiNode needs GPUs: it cannot run with server.device=cpu" }}
{{- end }}
{{- if ne (mul $gpus $pods) $world }}
{{- fail (printf "server.multiNode: tpSize x dpSize = %d GPUs must equal server.gpus (%d per node) x multiNode.nodes (%d); set tpSize to gpus x nodes" $world $gpus $pods) }}
{{- end }}
{{- else if and (not (include "dspark.isCPU" .)) (lt $gpus $world) }}
{{- fail (printf "server.gpus is %d but tpSize x dpSize = %d GPUs are needed per pod; raise server.gpus or leave it null" $gpus $world) }}
{{- end }}
{{- if ne (mod (int $s.tpSize) (int $s.attnDpSize)) 0 }}
{{- fail (printf "server.attnDpSize (%d) must divide server.tpSize (%d): DP attention splits the TP group" (int $s.attnDpSize) (int $s.tpSize)) }}
{{- end }}
{{- if ne (mod (int $s.tpSize) (int $s.epSize)) 0 }}
{{- fail (printf "server.epSize (%d) must divide server.tpSize (%d)" (int $s.epSize) (int $s.tpSize)) }}
{{- end }}
{{- if and (eq .Values.speculative.algorithm "DSPARK") (gt (int $s.attnDpSize) 1) }}
{{- if not $s.enableDpLmHead }}
{{- fail (printf "DSpark with DP attention (server.attnDpSize=%d) needs server.enableDpLmHead=true: SGLang 0.5.23 refuses it at start-up otherwise" (int $s.attnDpSize)) }}
{{- end }}
{{- if not (has $s.moeA2aBackend (list "" "none" "megamoe" "mori")) }}
{{- fail (printf "DSpark with DP attention supports server.moeA2aBackend none, megamoe or mori (SGLang 0.5.23), not %s" $s.moeA2aBackend) }}
{{- end }}
{{- if and (has $s.moeA2aBackend (list "megamoe" "mori")) (ne .Values.speculative.dspark.raggedVerifyMode "static") }}
{{- fail (printf "DSpark with DP attention and server.moeA2aBackend=%s needs speculative.dspark.raggedVerifyMode=static (and scheduler=static) in SGLang 0.5.23; use moeA2aBackend none to keep compact verify" $s.moeA2aBackend) }}
{{- end }}
{{- end }}
{{- if include "dspark.pd" . }}
{{- include "dspark.validatePD" . }}
{{- end }}
{{- if and .Values.autoscaling.enabled (eq .Values.autoscaling.engine "keda") (not .Values.monitoring.enableMetrics) }}
{{- fail "autoscaling.engine=keda reads SGLang's Prometheus gauges: it needs monitoring.enableMetrics=true" }}
{{- end }}
{{- if and .Values.autoscaling.enabled (eq .Values.autoscaling.engine "keda") (not .Values.autoscaling.keda.seriesSelector) (not .Values.monitoring.serviceMonitor.enabled) }}
{{- fail (printf "autoscaling.engine=keda queries SGLang's gauges with job=%q, the label the chart's ServiceMonitor gives them: set monitoring.serviceMonitor.enabled=true, or autoscaling.keda.seriesSelector to the labels your Prometheus gives this release's server series" .Release.Name) }}
{{- end }}
{{- if and (eq $s.cache.storage "persistentVolumeClaim") (not $s.cache.existingClaim) }}
{{- fail "server.cache.storage=persistentVolumeClaim needs server.cache.existingClaim (a ReadWriteMany claim shared by the server pods)" }}
{{- end }}
{{- if .Values.models.requirePinnedRevision }}
{{- range $role, $m := dict "target" .Values.models.target "draft" .Values.models.draft }}
{{- if and $m.repo (not (regexMatch "^[0-9a-f]{40}$" ($m.revision | default ""))) }}
{{- fail (printf "models.requirePinnedRevision: models.%s.revision for %s must be a commit (40 hex digits), not %q; the download logs the commit it fetched, or: python3 -c \"from huggingface_hub import HfApi; print(HfApi().model_info('%s').sha)\"" $role $m.repo ($m.revision | default "") $m.repo) }}
{{- end }}
{{- end }}
{{- end }}
{{- $labels := list }}
{{- range .Values.loadtest.arms }}
{{- if not (or .release .url) }}
{{- fail (printf "loadtest.arms: arm %q needs release (a release of this chart in this namespace) or url" .label) }}
{{- end }}
{{- if has .label $labels }}
{{- fail (printf "loadtest.arms: label %q is used twice" .label) }}
{{- end }}
{{- $labels = append $labels .label }}
{{- end }}
{{- if and (eq .Values.models.source "pvc") (not .Values.models.pvc.claimName) }}
{{- fail "models.source=pvc needs models.pvc.claimName (an existing PersistentVolumeClaim holding the models)" }}
{{- end }}
{{- if and (eq .Values.models.source "download") (eq .Values.models.download.storage "persistentVolumeClaim") (not .Values.models.download.persistentVolumeClaim.claimName) }}
{{- fail "models.download.storage=persistentVolumeClaim needs models.download.persistentVolumeClaim.claimName" }}
{{- end }}
{{- if and (eq .Values.models.source "image") (not .Values.models.target.path) }}
{{- fail "models.source=image needs models.target.path: the absolute path of the target model inside the image" }}
{{- end }}
{{- if and (eq .Values.speculative.algorithm "DSPARK") (eq .Values.models.source "image") .Values.models.draft.repo (not .Values.models.draft.path) }}
{{- fail "models.source=image needs models.draft.path: the absolute path of the draft model inside the image" }}
{{- end }}
{{- if and (include "dspark.isEagle" .) (not (include "dspark.draftPath" .)) (not (has .Values.speculative.algorithm (list "NEXTN" "EAGLE"))) }}
{{- fail (printf "speculative.algorithm=%s needs a draft model: set models.draft.repo or models.draft.path" .Values.speculative.algorithm) }}
{{- end }}
{{- end }}

{{/* What cannot work with server.disaggregation.enabled (the chart's PD topology, or what
SGLang 0.5.23 refuses at start-up). */}}
{{- define "dspark.validatePD" -}}
{{- $d := .Values.server.disaggregation }}
{{- $r := .Values.router }}
{{- if include "dspark.multiNode" . }}
{{- fail "server.disaggregation with server.multiNode: the chart renders each PD role as a StatefulSet of single-node replicas; turn one of them off (multi-node prefill or decode groups are not rendered)" }}
{{- end }}
{{- if .Values.autoscaling.enabled }}
{{- fail "server.disaggregation with autoscaling: the autoscaler scales one workload, PD has two (prefill and decode) whose ratio is yours to size; set autoscaling.enabled=false and size server.disaggregation.prefill.replicas / decode.replicas" }}
{{- end }}
{{- if not $r.enabled }}
{{- fail "server.disaggregation needs router.enabled=true: a PD request must go to a prefill and a decode server together (the router in --pd-disaggregation mode pairs them); no client can use one role alone" }}
{{- end }}
{{- if include "dspark.isCPU" . }}
{{- fail "server.disaggregation needs GPUs: SGLang's KV transfer (Mooncake or NIXL over RDMA) does not run with server.device=cpu" }}
{{- end }}
{{- if not (has $d.transferBackend (list "mooncake" "nixl")) }}
{{- fail (printf "server.disaggregation.transferBackend=%q: the chart renders mooncake or nixl (the KV cache over RDMA between GPU pods; the backend must be installed in the image). SGLang 0.5.23 also knows ascend (Ascend NPUs), mori (ROCm), mooncake_tcp and fake (moves no KV), which this chart does not set up" $d.transferBackend) }}
{{- end }}
{{- if eq (int $d.bootstrapPort) (int .Values.server.port) }}
{{- fail (printf "server.disaggregation.bootstrapPort (%d) must differ from server.port: the prefill server listens on both" (int $d.bootstrapPort)) }}
{{- end }}
{{- range $role := list "prefill" "decode" }}
{{- $cfg := index $d $role }}
{{- $policies := list (default $r.policy $cfg.policy) }}
{{- if eq $r.discovery "kubernetes" }}
{{- /* with discovery SMG runs in IGW mode, whose PD router may take router.policy for both roles */}}
{{- $policies = append $policies $r.policy }}
{{- end }}
{{- if and (has "power_of_two" $policies) (lt (int $cfg.replicas) 2) }}
{{- fail (printf "router policy power_of_two for the %s role with server.disaggregation.%s.replicas=%d: power_of_two picks the less loaded of two %s servers, with one it has nothing to choose from; set server.disaggregation.%s.policy (and router.policy) to round_robin, or run 2+ %s replicas" $role $role (int $cfg.replicas) $role $role $role) }}
{{- end }}
{{- end }}
{{- $spec := .Values.speculative }}
{{- if and (eq $spec.algorithm "DSPARK") (eq $d.targetModelType "deepseek_v41") (ne $spec.dspark.raggedVerifyMode "static") }}
{{- fail (printf "DSpark PD on DeepSeek-V4.1 (server.disaggregation.targetModelType=deepseek_v41) needs static verify: SGLang 0.5.23 refuses it at start-up otherwise (\"DeepSeek-V4.1 DSpark PD requires static verify, Mooncake or NIXL\"); set speculative.dspark.raggedVerifyMode=static and scheduler=static (got %s)" $spec.dspark.raggedVerifyMode) }}
{{- end }}
{{- end }}

{{/* JSON list of {repo, revision, dir} for the download init container. */}}
{{- define "dspark.downloadList" -}}
{{- $list := list }}
{{- range $role, $m := dict "target" .Values.models.target "draft" .Values.models.draft }}
{{- if $m.repo }}
{{- $list = append $list (dict "role" $role "repo" $m.repo "revision" ($m.revision | default "") "dir" (include "dspark.modelPath" (dict "ctx" $ "model" $m))) }}
{{- end }}
{{- end }}
{{- toJson $list }}
{{- end }}

{{- define "dspark.loadtestSecurityContext" -}}
allowPrivilegeEscalation: false
privileged: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
{{- end }}

{{/* "true" when a calibration file (calibration.sts or .sps) is used: `enabled` true, or
`enabled` null (the default) and a file given as content or existingConfigMap. Usage:
include "dspark.calibrationOn" .Values.calibration.sts */}}
{{- define "dspark.calibrationOn" -}}
{{- if kindIs "invalid" .enabled }}
{{- if or (not (empty .content)) (not (empty .existingConfigMap)) }}true{{ end }}
{{- else if .enabled }}true{{ end }}
{{- end }}

{{/* Space-separated labels of the load-test arms (a list of dicts). */}}
{{- define "dspark.armLabels" -}}
{{- $labels := list }}
{{- range . }}{{ $labels = append $labels .label }}{{ end }}
{{- join " " $labels }}
{{- end }}

{{/* The router's API key for test and load-test containers, when router.apiKey is set. */}}
{{- define "dspark.loadtestKeyEnv" -}}
{{- with .Values.router.apiKey.secretName }}
- name: SLA_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.router.apiKey.key }}
{{- end }}
{{- end }}

{{/* One arm's sweep: locust -f sla_auth.py (loadtest/sla.py) against the arm's URL, results in
/results/<run>/<label>/. Usage: include "dspark.sweepContainer" (dict "ctx" $ "arm" $arm "users" "1,2" "keepGoing" true):
keepGoing true (a sweep before others or before the report) exits 0 whatever locust returned. */}}
{{- define "dspark.sweepContainer" -}}
{{- $ := .ctx }}
{{- $lt := $.Values.loadtest }}
- name: {{ printf "sweep-%s" (regexReplaceAll "[^a-z0-9-]" .arm.label "-") | trunc 63 | trimSuffix "-" }}
  image: {{ printf "%s:%s" $lt.image.repository $lt.image.tag }}
  imagePullPolicy: {{ $lt.image.pullPolicy }}
  # The exit code is kept beside the summary; the report (or the last sweep) reports it.
  command:
    - /bin/sh
    - -c
    - mkdir -p "$SLA_OUTPUT_DIR" && locust "$@"; code=$?; echo "$code" > "$SLA_OUTPUT_DIR/locust.exit"; [ "$KEEP_GOING" = 1 ] || exit "$code"
    - locust
  args:
    - -f
    - /loadtest/sla_auth.py
    - --headless
    - --host
    - {{ .arm.url | quote }}
    - --csv
    - $(SLA_OUTPUT_DIR)/locust
    - --only-summary
  env:
    - name: RUN_NAME
      valueFrom:
        fieldRef:
          fieldPath: metadata.labels['batch.kubernetes.io/job-name']
    - name: SLA_OUTPUT_DIR
      value: {{ printf "/results/$(RUN_NAME)/%s" .arm.label | quote }}
    - name: SLA_LABEL
      value: {{ .arm.label | quote }}
    - name: SLA_USERS
      value: {{ .users | quote }}
    - name: SLA_STAGE_SECONDS
      value: {{ int $lt.stageSeconds | quote }}
    - name: SLA_MAX_TOKENS
      value: {{ int $lt.maxTokens | quote }}
    - name: SLA_TEMPERATURE
      value: {{ $lt.temperature | toString | quote }}
    - name: SLA_EXTRA_BODY
      value: {{ toJson (default (dict) $lt.extraBody) | quote }}
    - name: KEEP_GOING
      value: {{ ternary "1" "0" .keepGoing | quote }}
    - name: HOME
      value: /tmp
    {{- include "dspark.loadtestKeyEnv" $ | nindent 4 }}
  resources:
    {{- toYaml $lt.resources | nindent 4 }}
  securityContext:
    {{- include "dspark.loadtestSecurityContext" $ | nindent 4 }}
  volumeMounts:
    - name: loadtest
      mountPath: /loadtest
      readOnly: true
    - name: results
      mountPath: /results
    - name: tmp
      mountPath: /tmp
{{- end }}
