{{/* Chart name, truncated to the 63 characters of a label value. */}}
{{- define "switchboard.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full name: fullnameOverride, else "<release>-<name>" (just the release name when it already
contains the chart name). Truncated to 63 characters (DNS label).
*/}}
{{- define "switchboard.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "switchboard.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels: stable for the life of the release. */}}
{{- define "switchboard.selectorLabels" -}}
app.kubernetes.io/name: {{ include "switchboard.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{/* Labels of every object. */}}
{{- define "switchboard.labels" -}}
helm.sh/chart: {{ include "switchboard.chart" . }}
{{ include "switchboard.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: switchboard
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "switchboard.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "switchboard.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The operator image: repository:tag, the tag defaulting to appVersion. */}}
{{- define "switchboard.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The worker image: the operator's unless overridden. */}}
{{- define "switchboard.workerImage" -}}
{{- $repository := default .Values.image.repository .Values.worker.image.repository }}
{{- $tag := default (default .Chart.AppVersion .Values.image.tag) .Values.worker.image.tag }}
{{- printf "%s:%s" $repository $tag }}
{{- end }}

{{/* The Secret holding the operator's database URL, and its key. */}}
{{- define "switchboard.databaseSecretName" -}}
{{- if .Values.database.url }}
{{- printf "%s-database" (include "switchboard.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- required "set database.existingSecret.name (a Secret holding the PostgreSQL URL) or database.url" .Values.database.existingSecret.name }}
{{- end }}
{{- end }}

{{- define "switchboard.databaseSecretKey" -}}
{{- if .Values.database.url }}url{{ else }}{{ .Values.database.existingSecret.key }}{{ end }}
{{- end }}

{{/* Leader election: on when asked, and always with more than one replica. */}}
{{- define "switchboard.leaderElection" -}}
{{- if or .Values.leaderElection.enabled (gt (int .Values.replicaCount) 1) }}true{{ else }}false{{ end }}
{{- end }}

{{/*
The worker pod defaults as the operator's --worker-pod-defaults JSON. The workers' pull Secrets
default to the chart's own.
*/}}
{{- define "switchboard.workerPodDefaults" -}}
{{- $worker := .Values.worker }}
{{- dict
  "imagePullSecrets" (default .Values.imagePullSecrets $worker.imagePullSecrets)
  "serviceAccountName" $worker.serviceAccountName
  "nodeSelector" $worker.nodeSelector
  "tolerations" $worker.tolerations
  "affinity" $worker.affinity
  "topologySpreadConstraints" $worker.topologySpreadConstraints
  "priorityClassName" $worker.priorityClassName
  "resources" $worker.resources
  "podAnnotations" $worker.podAnnotations
  "podLabels" $worker.podLabels
  | toJson }}
{{- end }}
