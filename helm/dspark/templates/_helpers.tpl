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

{{/* GPUs per server pod. */}}
{{- define "dspark.gpus" -}}
{{- if not (kindIs "invalid" .Values.server.gpus) }}
{{- .Values.server.gpus | int }}
{{- else if include "dspark.isCPU" . }}
{{- 0 }}
{{- else }}
{{- mul (int .Values.server.tpSize) (int .Values.server.dpSize) }}
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
{{- $gpus := include "dspark.gpus" . | int }}
{{- $need := mul (int .Values.server.tpSize) (int .Values.server.dpSize) }}
{{- if and (not (include "dspark.isCPU" .)) (lt $gpus $need) }}
{{- fail (printf "server.gpus is %d but tpSize x dpSize = %d GPUs are needed per pod; raise server.gpus or leave it null" $gpus $need) }}
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
