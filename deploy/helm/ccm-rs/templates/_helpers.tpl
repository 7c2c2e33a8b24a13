{{- define "ccm-rs.labels" -}}
app.kubernetes.io/part-of: ccm-rs
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version }}
{{- end -}}

{{- define "ccm-rs.image" -}}
{{ .image.repository }}:{{ .image.tag | default .appVersion }}
{{- end -}}

{{/* The controllers' own ServiceAccounts and what each does. */}}
{{- define "ccm-rs.controllerRules" -}}
cloud-node-controller:
  - {apiGroups: [""], resources: [nodes], verbs: [get, patch]}
  - {apiGroups: [""], resources: [nodes/status], verbs: [patch]}
cloud-node-lifecycle-controller:
  - {apiGroups: [""], resources: [nodes], verbs: [patch, delete]}
route-controller:
  - {apiGroups: [""], resources: [nodes/status], verbs: [patch]}
service-lb-controller:
  - {apiGroups: [""], resources: [services], verbs: [patch]}
  - {apiGroups: [""], resources: [services/status], verbs: [patch]}
{{- end -}}
