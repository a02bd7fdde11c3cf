{{/*
Names and choices shared by the templates. Everything derived from the driver name lives here so
that one value renames the classes, their selectors, the sockets and the CDI vendor together.
*/}}

{{- define "gpu-dra.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "gpu-dra.fullname" -}}
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

{{- define "gpu-dra.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "gpu-dra.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gpu-dra.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: kubelet-plugin
{{- with .Values.selectorLabelsOverride }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "gpu-dra.labels" -}}
helm.sh/chart: {{ include "gpu-dra.chart" . }}
app.kubernetes.io/name: {{ include "gpu-dra.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "gpu-dra.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (printf "%s-kubelet-plugin" (include "gpu-dra.fullname" .)) .Values.serviceAccount.name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Class of whole GPUs: the driver name itself (gpu.nvidia.com). */}}
{{- define "gpu-dra.gpuClassName" -}}
{{- .Values.driverName }}
{{- end }}

{{/* Class of MIG devices: gpu.nvidia.com -> mig.nvidia.com; another name gets a "mig." prefix. */}}
{{- define "gpu-dra.migClassName" -}}
{{- if hasPrefix "gpu." .Values.driverName }}
{{- printf "mig.%s" (trimPrefix "gpu." .Values.driverName) }}
{{- else }}
{{- printf "mig.%s" .Values.driverName | trunc 253 }}
{{- end }}
{{- end }}

{{/* The selector of a class: the same expression the code ships (dra_driver/devices/classes.py). */}}
{{- define "gpu-dra.classExpression" -}}
{{- $driver := index . 0 }}{{- $type := index . 1 -}}
device.driver == '{{ $driver }}' && device.attributes['{{ $driver }}'].type == '{{ $type }}'
{{- end }}

{{/*
True when .Capabilities came from a live cluster's discovery: it then lists group/version/Kind
entries (v1/Pod). Offline `helm template` only knows bare group/versions, so kind checks say nothing.
*/}}
{{- define "gpu-dra.discovered" -}}
{{- if .Capabilities.APIVersions.Has "v1/Pod" }}true{{ end }}
{{- end }}

{{/* resource.k8s.io version of the DeviceClasses: forced by value, else the newest served. */}}
{{- define "gpu-dra.resourceApiVersion" -}}
{{- $caps := .Capabilities.APIVersions }}
{{- if .Values.resourceApiVersion }}
{{- .Values.resourceApiVersion }}
{{- else if $caps.Has "resource.k8s.io/v1/DeviceClass" }}v1
{{- else if $caps.Has "resource.k8s.io/v1beta2/DeviceClass" }}v1beta2
{{- else if $caps.Has "resource.k8s.io/v1beta1/DeviceClass" }}v1beta1
{{- else if include "gpu-dra.discovered" . }}
{{- fail "the cluster serves no resource.k8s.io DeviceClass (v1, v1beta2 or v1beta1): gpu-dra needs Kubernetes >= 1.32 with Dynamic Resource Allocation enabled" }}
{{- else if $caps.Has "resource.k8s.io/v1" }}v1
{{- else if $caps.Has "resource.k8s.io/v1beta2" }}v1beta2
{{- else }}v1beta1
{{- end }}
{{- end }}

{{/*
The extendedResourceName of the whole-GPU class: the value, only on classes written in
resource.k8s.io/v1 (as NVIDIA's chart does; empty: none).
*/}}
{{- define "gpu-dra.gpuExtendedResourceName" -}}
{{- if eq (include "gpu-dra.resourceApiVersion" .) "v1" }}
{{- .Values.deviceClasses.gpuExtendedResourceName }}
{{- end }}
{{- end }}

{{/* Whether to render the ValidatingAdmissionPolicy: wanted, and served (or offline, unknown). */}}
{{- define "gpu-dra.admissionPolicy" -}}
{{- if .Values.admissionPolicy.enabled }}
{{- if .Capabilities.APIVersions.Has "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy" }}true
{{- else if not (include "gpu-dra.discovered" .) }}true
{{- end }}
{{- end }}
{{- end }}

{{- define "gpu-dra.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/*
Scrape settings with the DCGM-compatible series on. Those series carry the pod, namespace and
container of each claim's pods, as dcgm-exporter's do (honorLabels keeps them instead of renaming
them exported_*). The agent's own pod, namespace and container are moved to agent_pod and
agent_namespace and dropped as pod/namespace/container, so a GPU no claim holds names no pod: a
`sum by (namespace)` counts it under no namespace rather than the agent's. Every series keeps its
node label; two agents of one node during a rolling update differ by instance and agent_pod.
*/}}
{{- define "gpu-dra.podLabelRelabelings" -}}
honorLabels: true
relabelings:
  - sourceLabels: [__meta_kubernetes_pod_name]
    targetLabel: agent_pod
  - sourceLabels: [__meta_kubernetes_namespace]
    targetLabel: agent_namespace
  - action: labeldrop
    regex: pod|namespace|container
{{- end }}
