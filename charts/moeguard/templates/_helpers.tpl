{{/* vim: set filetype=mustache: */}}
{{/*
Chart name, truncated to 63 characters (the DNS-1123 label limit).
*/}}
{{- define "moeguard.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Fully qualified app name, truncated to 63 characters. If the release name contains the
chart name it is used as the full name.
*/}}
{{- define "moeguard.fullname" -}}
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

{{/*
A name derived from the full name with a suffix; the full name is shortened so that the
result still fits in 63 characters. Usage: include "moeguard.suffixed" (list . "metrics")
*/}}
{{- define "moeguard.suffixed" -}}
{{- $ctx := index . 0 }}
{{- $suffix := index . 1 }}
{{- $max := sub 62 (len $suffix) | int }}
{{- printf "%s-%s" (include "moeguard.fullname" $ctx | trunc $max | trimSuffix "-") $suffix }}
{{- end }}

{{/*
Chart name and version, as used by the helm.sh/chart label.
*/}}
{{- define "moeguard.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Common labels.
*/}}
{{- define "moeguard.labels" -}}
helm.sh/chart: {{ include "moeguard.chart" . }}
{{ include "moeguard.selectorLabels" . }}
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | trunc 63 | trimSuffix "-" | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: moeguard
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
Selector labels (stable for the life of the release).
*/}}
{{- define "moeguard.selectorLabels" -}}
app.kubernetes.io/name: {{ include "moeguard.name" . }}
app.kubernetes.io/instance: {{ .Release.Name | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/component: operator
{{- end }}

{{/*
Name of the operator's ServiceAccount.
*/}}
{{- define "moeguard.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "moeguard.fullname" .) .Values.serviceAccount.name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The operator image: repository@digest when a digest is set, else repository:tag (tag defaults
to the chart's appVersion).
*/}}
{{- define "moeguard.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}
{{- end }}

{{/*
Namespace for the monitoring objects (ServiceMonitor, PrometheusRule, dashboard).
*/}}
{{- define "moeguard.monitoringNamespace" -}}
{{- default .Release.Namespace .namespace }}
{{- end }}

{{/*
The operator's command-line arguments (python -m moeguard_operator ...).
*/}}
{{- define "moeguard.args" -}}
{{- if .Values.operator.watchNamespaces }}
{{- range .Values.operator.watchNamespaces }}
- --namespace={{ . }}
{{- end }}
{{- else }}
- --all-namespaces
{{- end }}
{{- if .Values.operator.peering.enabled }}
- --peering={{ .Values.operator.peering.name }}
{{- else }}
- --standalone
{{- end }}
- --log-level={{ .Values.operator.logLevel }}
- --policy={{ .Values.operator.policy }}
- --liveness=http://0.0.0.0:{{ .Values.operator.livenessPort }}/healthz
{{- if .Values.metrics.enabled }}
- --metrics-port={{ .Values.metrics.port }}
{{- end }}
{{- with .Values.operator.prometheusUrl }}
- --prometheus-url={{ . }}
{{- end }}
{{- if .Values.operator.allowSecrets }}
- --allow-secrets
{{- end }}
{{- range .Values.operator.prometheus.allowedUrls }}
- --allowed-prometheus-url={{ . }}
{{- end }}
{{- if (include "moeguard.prometheusCaVolume" .) }}
- --prometheus-ca-file=/etc/moeguard/prometheus-ca/{{ .Values.operator.prometheus.caBundle.key }}
{{- end }}
{{- with .Values.operator.extraArgs }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
The volume holding the Prometheus CA bundle (operator.prometheus.caBundle), or nothing.
*/}}
{{- define "moeguard.prometheusCaVolume" -}}
{{- $ca := .Values.operator.prometheus.caBundle -}}
{{- if and $ca.configMap $ca.secret -}}
{{- fail "operator.prometheus.caBundle: set configMap or secret, not both" -}}
{{- else if $ca.configMap -}}
- name: prometheus-ca
  configMap:
    name: {{ $ca.configMap }}
    items:
      - key: {{ $ca.key }}
        path: {{ $ca.key }}
{{- else if $ca.secret -}}
- name: prometheus-ca
  secret:
    secretName: {{ $ca.secret }}
    items:
      - key: {{ $ca.key }}
        path: {{ $ca.key }}
{{- end -}}
{{- end }}
