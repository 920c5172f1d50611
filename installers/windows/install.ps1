<#
.SYNOPSIS
    Installs the GPUFlex volunteer node for the current user (no admin rights).

.DESCRIPTION
    Creates a venv in %LOCALAPPDATA%\gpuflex (or -Prefix), installs gpuflex with the
    PyTorch build for this machine (CUDA when nvidia-smi sees a GPU), and registers the
    scheduled task "GPUFlex Node" that starts at logon of the current user, at
    BelowNormal priority, without a console window. A small launcher restarts the node
    with backoff when it fails. Re-running upgrades in place.

.EXAMPLE
    .\install.ps1 -Hub https://hub.example.org:8470 -HubKey gf1-abcd-efgh-ijkl-mnop-qrst
.EXAMPLE
    .\install.ps1 -Uninstall            # add -KeepIdentity to keep node.key and hub.pin
#>
[CmdletBinding()]
param(
    [string]$Hub = '',
    [string]$HubKey = '',
    [string]$Prefix = '',
    [ValidateSet('cpu', 'cuda', 'auto')]
    [string]$Torch = 'auto',
    [string]$Source = '',
    [switch]$NoStart,
    [switch]$DryRun,
    [switch]$Uninstall,
    [switch]$KeepIdentity
)

Set-StrictMode -Version Latest
$ErrorActionPreference = 'Stop'

$TaskName = 'GPUFlex Node'
$Marker = '.gpuflex-install'

function Stop-WithError([string]$Message, [int]$Code = 1) {
    [Console]::Error.WriteLine("install.ps1: error: $Message")
    exit $Code
}

function Invoke-Action([string]$Description, [scriptblock]$Action) {
    # Every change goes through here, so -DryRun prints it and does nothing.
    if ($DryRun) {
        Write-Output "+ $Description"
        return
    }
    & $Action
}

function Invoke-Native([string]$What, [string]$Exe, [string[]]$Arguments) {
    Invoke-Action "$Exe $($Arguments -join ' ')" {
        & $Exe @Arguments
        if ($LASTEXITCODE -ne 0) { Stop-WithError "$What failed (exit $LASTEXITCODE)" }
    }
}

# ------------------------------------------------------------------------------ arguments

if ($KeepIdentity -and -not $Uninstall) { Stop-WithError '-KeepIdentity only goes with -Uninstall' 2 }
if (-not $Uninstall) {
    if (-not $Hub) { Stop-WithError '-Hub URL is required (the hub this node trains for, e.g. -Hub https://hub.example.org:8470)' 2 }
    if ($Hub -notmatch '^https?://[^\s"''`$%<>&]+$') { Stop-WithError "-Hub must be an http:// or https:// URL without quotes or spaces, not '$Hub'" 2 }
    if ($HubKey -and $HubKey -cnotmatch '^gf1(-[a-z2-7]{4}){5}$') {
        Stop-WithError "-HubKey must be a hub key fingerprint like gf1-abcd-efgh-ijkl-mnop-qrst, not '$HubKey'" 2
    }
}
if (-not $env:LOCALAPPDATA) { Stop-WithError 'LOCALAPPDATA is not set; run this as a normal Windows user' }
if (-not $Prefix) { $Prefix = Join-Path $env:LOCALAPPDATA 'gpuflex' }
$Prefix = [System.IO.Path]::GetFullPath($Prefix)
$Venv = Join-Path $Prefix 'venv'
$NodeDir = Join-Path $Prefix 'node'
$LogDir = Join-Path $Prefix 'logs'
$Launcher = Join-Path $Prefix 'launch_node.py'
$VenvPython = Join-Path $Venv 'Scripts\python.exe'
$VenvPythonW = Join-Path $Venv 'Scripts\pythonw.exe'

# ------------------------------------------------------------------------------ helpers

function Find-Python {
    # Returns a command line such as 'py -3.12' (split it on spaces), or '' when none fits.
    foreach ($cand in @('py -3.13', 'py -3.12', 'py -3.11', 'python', 'python3')) {
        $parts = @($cand -split ' ')
        if (-not (Get-Command $parts[0] -ErrorAction SilentlyContinue)) { continue }
        $pre = @($parts | Select-Object -Skip 1)
        & $parts[0] @pre -c 'import sys, venv; sys.exit(sys.version_info < (3, 11))' 2>$null
        if ($LASTEXITCODE -eq 0) { return $cand }
    }
    return ''
}

function Get-TorchFlavour {
    if ($Torch -ne 'auto') { return $Torch }
    if (Get-Command nvidia-smi -ErrorAction SilentlyContinue) {
        & nvidia-smi -L *> $null
        if ($LASTEXITCODE -eq 0) { return 'cuda' }
    }
    return 'cpu'
}

function Get-LauncherText {
    # Runs under pythonw.exe (no console window): sends output to a log file and
    # restarts the node with exponential backoff when it exits with an error.
    $log = (Join-Path $LogDir 'node.log').Replace('\', '\\')
    $py = $VenvPython.Replace('\', '\\')
    return @"
# GPUFlex node launcher, written by installers/windows/install.ps1.
import subprocess, sys, time
LOG = "$log"
PYTHON = "$py"
BELOW_NORMAL, NO_WINDOW = 0x00004000, 0x08000000
delay = 10.0
while True:
    with open(LOG, "a", encoding="utf-8") as log:
        started = time.monotonic()
        code = subprocess.call([PYTHON, "-m", "gpuflex.node", *sys.argv[1:]], stdout=log,
                               stderr=subprocess.STDOUT, creationflags=BELOW_NORMAL | NO_WINDOW)
        log.write(f"gpuflex-node exited with {code}\n")
    if code == 0:
        break
    if time.monotonic() - started > 600:
        delay = 10.0
    time.sleep(delay)
    delay = min(delay * 2, 900.0)
"@
}

function Stop-NodeProcesses {
    $prefixLower = $Venv.ToLowerInvariant()
    Get-Process -ErrorAction SilentlyContinue |
        Where-Object { $_.Path -and $_.Path.ToLowerInvariant().StartsWith($prefixLower) } |
        ForEach-Object {
            $proc = $_
            Invoke-Action "Stop-Process -Id $($proc.Id) ($($proc.Path))" { Stop-Process -Id $proc.Id -Force }
        }
}

# ------------------------------------------------------------------------------ uninstall

function Uninstall-Node {
    if ($DryRun) { Write-Output '(dry run: nothing is changed)' }
    Write-Output "==> removing the GPUFlex node from $Prefix"
    if (Get-ScheduledTask -TaskName $TaskName -ErrorAction SilentlyContinue) {
        Invoke-Action "Stop-ScheduledTask -TaskName '$TaskName'" { Stop-ScheduledTask -TaskName $TaskName }
        Invoke-Action "Unregister-ScheduledTask -TaskName '$TaskName'" {
            Unregister-ScheduledTask -TaskName $TaskName -Confirm:$false
        }
    }
    Stop-NodeProcesses
    if (Test-Path -LiteralPath $Prefix) {
        if (-not (Test-Path -LiteralPath (Join-Path $Prefix $Marker))) {
            Write-Warning "$Prefix has no $Marker marker; leaving it alone"
        } elseif ($KeepIdentity) {
            Get-ChildItem -LiteralPath $Prefix -Force |
                Where-Object { $_.Name -ne 'node' -and $_.Name -ne $Marker } |
                ForEach-Object {
                    $item = $_
                    Invoke-Action "Remove-Item -Recurse '$($item.FullName)'" { Remove-Item -LiteralPath $item.FullName -Recurse -Force }
                }
            if (Test-Path -LiteralPath $NodeDir) {
                Get-ChildItem -LiteralPath $NodeDir -Force |
                    Where-Object { $_.Name -ne 'node.key' -and $_.Name -ne 'hub.pin' } |
                    ForEach-Object {
                        $item = $_
                        Invoke-Action "Remove-Item -Recurse '$($item.FullName)'" { Remove-Item -LiteralPath $item.FullName -Recurse -Force }
                    }
            }
            Write-Output "kept the node identity in $NodeDir (node.key, hub.pin)"
        } else {
            Invoke-Action "Remove-Item -Recurse '$Prefix'" { Remove-Item -LiteralPath $Prefix -Recurse -Force }
        }
    }
    Write-Output 'GPUFlex node removed.'
}

# ------------------------------------------------------------------------------ install

function Install-Node {
    $flavour = Get-TorchFlavour
    $torchSpec = if ($env:GPUFLEX_TORCH_SPEC) { $env:GPUFLEX_TORCH_SPEC } else { 'torch' }
    # PyPI's Windows wheels are the CPU build; CUDA builds come from the PyTorch index.
    $defaultIndex = if ($flavour -eq 'cuda') { 'https://download.pytorch.org/whl/cu128' } else { '' }
    $torchIndex = if (Test-Path Env:GPUFLEX_TORCH_INDEX) { $env:GPUFLEX_TORCH_INDEX } else { $defaultIndex }
    $src = if ($Source) { $Source } else { (Resolve-Path (Join-Path $PSScriptRoot '..\..')).Path }
    $extra = if ($flavour -eq 'cuda') { '[gpu]' } else { '' }

    if ($DryRun) { Write-Output '(dry run: nothing is changed)' }
    Write-Output "==> GPUFlex node: hub $Hub, torch $flavour, into $Prefix"
    if ((Test-Path -LiteralPath $Prefix) -and -not (Test-Path -LiteralPath (Join-Path $Prefix $Marker)) -and
        (Get-ChildItem -LiteralPath $Prefix -Force | Select-Object -First 1)) {
        Stop-WithError "$Prefix exists, is not empty and was not made by this installer; choose an empty folder with -Prefix"
    }
    foreach ($dir in @($Prefix, $NodeDir, $LogDir)) {
        Invoke-Action "New-Item -ItemType Directory '$dir'" { New-Item -ItemType Directory -Force -Path $dir | Out-Null }
    }
    Invoke-Action "write $Prefix\$Marker" {
        Set-Content -LiteralPath (Join-Path $Prefix $Marker) -Value 'This folder belongs to the GPUFlex node installer.'
    }

    if (Get-ScheduledTask -TaskName $TaskName -ErrorAction SilentlyContinue) {
        # A running node holds its venv's files open; pip cannot replace them.
        Invoke-Action "Stop-ScheduledTask -TaskName '$TaskName'" { Stop-ScheduledTask -TaskName $TaskName }
    }
    Stop-NodeProcesses
    if (Test-Path -LiteralPath $VenvPython) {
        Write-Output "==> upgrading the existing venv in $Venv"
    } else {
        $python = Find-Python
        if (-not $python) { Stop-WithError 'no Python >= 3.11 found; install it from python.org (tick "py launcher") and re-run' }
        $parts = @($python -split ' ')
        $pyExe = $parts[0]
        $pyPre = @($parts | Select-Object -Skip 1)
        Invoke-Native 'creating the venv' $pyExe ($pyPre + @('-m', 'venv', $Venv))
    }
    $pip = @('-m', 'pip', 'install', '--disable-pip-version-check', '--no-input')
    $torchArgs = $pip + @()
    if ($torchIndex) { $torchArgs += @('--index-url', $torchIndex) }
    Invoke-Native 'installing torch' $VenvPython ($torchArgs + @($torchSpec))
    if (Test-Path -LiteralPath $src -PathType Container) {
        $stage = Join-Path ([System.IO.Path]::GetTempPath()) ("gpuflex-src-" + [guid]::NewGuid().ToString('N'))
        Invoke-Action "copy $src to $stage (without .git, .venv, build)" {
            robocopy $src $stage /E /NFL /NDL /NJH /NJS /NP /XD .git .venv build dist __pycache__ .pytest_cache .mypy_cache .ruff_cache | Out-Null
            if ($LASTEXITCODE -ge 8) { Stop-WithError "cannot copy the source tree $src" }
        }
        Invoke-Native 'installing gpuflex' $VenvPython ($pip + @('--upgrade', '--upgrade-strategy', 'only-if-needed', "$stage$extra"))
        Invoke-Action "Remove-Item -Recurse '$stage'" { Remove-Item -LiteralPath $stage -Recurse -Force }
    } else {
        Invoke-Native 'installing gpuflex' $VenvPython ($pip + @('--upgrade', '--upgrade-strategy', 'only-if-needed', $src))
    }
    Invoke-Native 'gpuflex-node --version' $VenvPython @('-m', 'gpuflex.node', '--version')

    Invoke-Action "write $Launcher" { Set-Content -LiteralPath $Launcher -Value (Get-LauncherText) -Encoding utf8 }

    $nodeArgs = @("`"$Launcher`"", 'run', '--hub', "`"$Hub`"")
    if ($HubKey) { $nodeArgs += @('--hub-key', $HubKey) }
    $nodeArgs += @('--data-dir', "`"$NodeDir`"")
    $argumentLine = $nodeArgs -join ' '
    $user = "$env:USERDOMAIN\$env:USERNAME"
    Write-Output "==> registering the scheduled task '$TaskName' for $user"
    Invoke-Action "Register-ScheduledTask '$TaskName': $VenvPythonW $argumentLine (at logon, BelowNormal)" {
        $action = New-ScheduledTaskAction -Execute $VenvPythonW -Argument $argumentLine -WorkingDirectory $NodeDir
        $trigger = New-ScheduledTaskTrigger -AtLogOn -User $user
        $principal = New-ScheduledTaskPrincipal -UserId $user -LogonType Interactive -RunLevel Limited
        # Priority 7 = BelowNormal. No time limit; restart if the task itself fails;
        # default battery rules (do not start on battery, stop when unplugged).
        $settings = New-ScheduledTaskSettingsSet -Priority 7 -ExecutionTimeLimit ([TimeSpan]::Zero) `
            -RestartCount 999 -RestartInterval (New-TimeSpan -Minutes 1) `
            -MultipleInstances IgnoreNew -StartWhenAvailable
        Register-ScheduledTask -TaskName $TaskName -Action $action -Trigger $trigger -Principal $principal `
            -Settings $settings -Description 'GPUFlex volunteer training node (installers/windows/install.ps1)' -Force | Out-Null
    }
    if ($NoStart) {
        Write-Output ''
        Write-Output "Installed, not started. It starts at your next logon, or now with: Start-ScheduledTask -TaskName '$TaskName'"
    } else {
        Invoke-Action "Start-ScheduledTask -TaskName '$TaskName'" { Start-ScheduledTask -TaskName $TaskName }
        Write-Output ''
        Write-Output 'The GPUFlex node is running in the background and starts at every logon.'
    }
    Write-Output "  status:    Get-ScheduledTask -TaskName '$TaskName' | Get-ScheduledTaskInfo"
    Write-Output "  logs:      Get-Content -Wait '$LogDir\node.log'"
    Write-Output "  node:      & '$Venv\Scripts\gpuflex-node.exe' status --data-dir '$NodeDir'"
    Write-Output "  pause:     Stop-ScheduledTask -TaskName '$TaskName'    (resume: Start-ScheduledTask -TaskName '$TaskName')"
    Write-Output "  uninstall: & '$PSCommandPath' -Uninstall"
}

if ($Uninstall) { Uninstall-Node } else { Install-Node }
